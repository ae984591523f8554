"""The floors a benchmark states, checked: each ``check`` returns PASS or FAIL for the table,
and ``finish`` ends the process with status 1 when any floor was missed, so ``make bench``
is a check and not a printout.

    floors = Floors()
    print(f"... {floors.check('async checkpoint share <= 5%', share <= 0.05)}")
    floors.finish()
"""

from __future__ import annotations

import sys


class Floors:
    def __init__(self) -> None:
        self.missed: list[str] = []
        self.checked = 0

    def check(self, what: str, ok: bool) -> str:
        self.checked += 1
        if not ok:
            self.missed.append(what)
        return "PASS" if ok else "FAIL"

    def finish(self) -> None:
        if self.missed:
            print(f"\n{len(self.missed)} of {self.checked} floors missed:")
            for what in self.missed:
                print(f"  {what}")
            sys.exit(1)
        print(f"\nevery floor met ({self.checked})")
