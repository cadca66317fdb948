"""Compare two records of the attack suite's ratios (``PE_ATTACK_RECORD=FILE pytest
tests/privacy`` in two checkouts): every test's sequence of ratios must be bit-identical.

    python tests/privacy/compare_attack_records.py OLD NEW

Prints the tests whose ratios differ (or that only one record has) and exits 1 if any do.
"""
import sys
from collections import defaultdict


def load(path):
    """``{test id: [ratio text, ...]}`` in the order the ratios were measured."""
    found = defaultdict(list)
    with open(path) as f:
        for line in f:
            test, _, value = line.rstrip("\n").partition("\t")
            found[test].append(value)
    return found


def main(old_path, new_path) -> int:
    old, new = load(old_path), load(new_path)
    differ = sorted(t for t in old.keys() & new.keys() if old[t] != new[t])
    only = sorted(old.keys() ^ new.keys())
    for t in differ:
        print(f"differs: {t}\n  old {old[t]}\n  new {new[t]}")
    for t in only:
        print(f"in one record only: {t}")
    same = len(old.keys() & new.keys()) - len(differ)
    print(f"{same} tests bit-identical, {len(differ)} differ, {len(only)} in one record only "
          f"({sum(map(len, new.values()))} ratios in the new record)")
    return 1 if differ or only else 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:3]))
