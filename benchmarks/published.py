"""Claim: the cost model (scaletrain/analysis/costmodel.py) predicts published multi-node
throughput within 15%, each row from its source's own hardware description and its own
one-node figure (scaletrain/analysis/published.toml: the sources, their citations and the
hardware each used).

    python benchmarks/published.py

prints predicted beside published for every row, and exits 1 if a row is off by more than
15% (or a row marked a miss, with its reason, is no longer one). Nothing is measured here:
the figures are the sources'. tests/unit/test_costmodel.py checks the same rows in make
test.
"""

from __future__ import annotations

from floors import Floors

from scaletrain.analysis.costmodel import check_published


def main() -> None:
    floors = Floors()
    print(f"{'source':<20} {'model':<44} {'GPUs':>5} {'published':>10} {'predicted':>10}  ratio")
    for c in check_published():
        if c.miss:  # a known miss, explained in published.toml: it must still be one
            ok = floors.check(f"{c.source} {c.model} at {c.gpus}: the miss it is marked",
                              not c.within)  # fmt: skip
        else:
            ok = floors.check(f"{c.source} {c.model} at {c.gpus}: within 15%", c.within)
        print(f"{c.source:<20} {c.model:<52} {c.gpus:>5} {c.published:>10,.0f} "
              f"{c.predicted:>10,.0f}  {c.ratio:.2f} {ok}  ({c.unit})")  # fmt: skip
        if c.miss:
            print(f"    marked a miss: {c.miss}")
    floors.finish()


if __name__ == "__main__":
    main()
