"""pass@1 of the benchmarks' own canonical solutions under `eval.programs.check_completion`: every
code benchmark's checker must pass its reference answers (HumanEval 164, MBPP 500, and an EvalPlus-
style differential test built from HumanEval: each problem's inputs are the arguments its original
tests pass, recorded by running them against the canonical solution).

    python scripts/canonical_pass.py [--limit N] [--workers 2]
"""

from __future__ import annotations

import argparse
import copy
from concurrent.futures import ThreadPoolExecutor

from free_transformer.eval.catalog import get_benchmark
from free_transformer.eval.programs import check_completion


def recorded_inputs(row: dict) -> list:
    """The argument lists HumanEval's test passes to the function, in order (run on the reference)."""
    namespace: dict = {}
    exec(row["prompt"] + row["canonical_solution"], namespace)
    reference, calls = namespace[row["entry_point"]], []

    def recording(*args):
        calls.append(copy.deepcopy(list(args)))
        return reference(*args)

    exec(row["test"], namespace)
    namespace["check"](recording)
    return calls


def cases(limit: int | None) -> dict[str, list[tuple[dict, str]]]:
    humaneval = list(get_benchmark("humaneval").rows(None)[0])[:limit]
    mbpp = list(get_benchmark("mbpp").rows(None)[0])[:limit]
    plus = get_benchmark("humaneval_plus")
    return {
        "humaneval": [(get_benchmark("humaneval").test(r), r["canonical_solution"]) for r in humaneval],
        "mbpp": [(get_benchmark("mbpp").test(r), r["code"].replace("\r\n", "\n")) for r in mbpp],
        "evalplus": [(plus.test({**r, "base_input": recorded_inputs(r)}), r["canonical_solution"]) for r in humaneval],
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--limit", type=int, default=None, help="problems per benchmark (default: all)")
    parser.add_argument("--workers", type=int, default=2)
    args = parser.parse_args()
    with ThreadPoolExecutor(args.workers) as pool:
        for name, items in cases(args.limit).items():
            results = list(pool.map(lambda item: check_completion(*item), items))
            failed = [i for i, r in enumerate(results) if not r.passed]
            print(
                f"{name:10s} pass@1 {sum(r.passed for r in results) / len(results):.4f} "
                f"({len(results) - len(failed)}/{len(results)}); not passed: {failed}",
                flush=True,
            )


if __name__ == "__main__":
    main()
