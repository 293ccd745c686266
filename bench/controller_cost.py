"""What the adaptive speculation controller's plan costs the host a step (issue 13).

Every verify step plans the draft lengths of all its agents (`Controller.plan`): each agent's
acceptance rates, merged, against the step profile. This times the plan for `--agents` agents
whose stats are recorded as a verify step records them (a quarter of the agents each step, so
the shared prior changes every step), best of `--repeats`, and with `--against FILE` (another
version of `hibana_core/speculation/controller.py`, e.g. `git show REV:hibana_core/speculation/
controller.py > /tmp/old.py`) the same beside it in one process, checking that both plan alike.

    python3 bench/controller_cost.py [--agents 32] [--steps 300] [--repeats 3] [--against /tmp/old.py]
"""

from __future__ import annotations

import argparse
import importlib.util
import random
import sys
import time
from types import ModuleType

import hibana_core.speculation.controller as current

POINTS = [1, 2, 4, 8, 16, 32, 64, 128, 256, 512]


def run(module: ModuleType, agents: int, steps: int) -> tuple[float, list]:
    """Microseconds a plan, and the plans made (seeded: the same for every version)."""
    rng = random.Random(0)
    costs = module.StepCostModel(POINTS, [0.01 + 0.0001 * t for t in POINTS], 0.002)
    prior = module.AcceptanceStats()
    stats = [module.AcceptanceStats(prior) for _ in range(agents)]
    for s in stats:
        for _ in range(50):
            k = rng.randint(1, 16)
            s.record(k, rng.randint(0, k))
    controller = module.Controller(costs)
    candidates = [module.Candidate(s, 16, None) for s in stats]
    plans, start = [], time.perf_counter()
    for step in range(steps):
        for s in stats[step % 4::4]:
            s.record(4, rng.randint(0, 4))
        plans.append(controller.plan(candidates, agents, agents))
    return (time.perf_counter() - start) / steps * 1e6, plans


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--agents", type=int, default=32)
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--against", help="another controller.py to time beside this one")
    args = parser.parse_args()
    versions = {"this": current}
    if args.against:
        spec = importlib.util.spec_from_file_location("controller_against", args.against)
        versions["against"] = sys.modules["controller_against"] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(versions["against"])  # (registered first: its dataclasses look it up)
    best, plans = {name: float("inf") for name in versions}, {}
    for _ in range(args.repeats):
        for name, module in versions.items():
            us, plans[name] = run(module, args.agents, args.steps)
            best[name] = min(best[name], us)
    same = "" if len(plans) < 2 else f"; the same plans: {plans['this'] == plans['against']}"
    print(f"{args.agents} agents, {args.steps} steps, best of {args.repeats}: " +
          ", ".join(f"{name} {us:.0f} us a plan" for name, us in best.items()) + same)


if __name__ == "__main__":
    main()
