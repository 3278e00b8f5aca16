"""The verdict of a client library's own tests run straight on Redis and
through lockgate (scripts/redis-py-locks.sh, scripts/library-suites.sh).

    junit_verdict.py EXCEPTIONS LABEL DIRECT.xml GATED.xml [LABEL DIRECT GATED]...

Reads pytest's JUnit reports. For each LABEL, every test that passed in
DIRECT.xml must pass in GATED.xml, unless EXCEPTIONS names it: a line
"test|regex|why" (test as module.Class::name) says it must fail through
lockgate with a message the regex finds, a deliberate difference of
lockgate's (docs/behaviour.md). Prints per LABEL how many passed each way
and the names of what was lost; warns of exceptions no longer needed.

Exit status: 0 when nothing was lost beyond the exceptions, 1 otherwise.
"""

import re
import sys
import xml.etree.ElementTree as ET


def results(path):
    """{test: (passed, failure message)} of one JUnit report."""
    out = {}
    for case in ET.parse(path).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped") is not None
        out[test] = (bad is None and not skipped, None if bad is None else bad.get("message", ""))
    return out


def main(argv):
    exceptions = {}
    for line in open(argv[1]):
        if line.strip():
            test, message, why = line.rstrip("\n").split("|", 2)
            exceptions[test] = (re.compile(message), why)
    runs = argv[2:]
    if not runs or len(runs) % 3:
        sys.exit(__doc__)
    failed = False
    excepted = set()
    for label, direct_xml, gated_xml in zip(runs[0::3], runs[1::3], runs[2::3]):
        direct, gated = results(direct_xml), results(gated_xml)
        baseline = sorted(t for t, (ok, _) in direct.items() if ok)
        if not baseline:
            print(f"{label}: no test passed directly", file=sys.stderr)
            failed = True
            continue
        lost = [t for t in baseline if not gated.get(t, (False, "did not run"))[0]]
        print(f"\n{label}: {len(baseline)} pass directly, {len(baseline) - len(lost)} through lockgate")
        for test in lost:
            message = gated.get(test, (False, "did not run"))[1] or ""
            first = message.splitlines()[0] if message else ""
            rule = exceptions.get(test)
            if rule and rule[0].search(message):
                print(f"    excepted ({rule[1]}): {test}: {first}")
                excepted.add(test)
            else:
                print(f"    LOST: {test}: {first}")
                failed = True
    for test in sorted(set(exceptions) - excepted):
        print(f"warning: exception no longer needed (passes through lockgate or not directly): {test}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
