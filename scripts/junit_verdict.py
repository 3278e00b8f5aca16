"""The verdict of a client library's own tests run straight on Redis and
through lockgate (scripts/redis-py-locks.sh, scripts/library-suites.sh).

    junit_verdict.py EXCEPTIONS LABEL DIRECT.xml GATED.xml[,RERUN.xml...] ...
    junit_verdict.py --lost EXCEPTIONS SUITE_DIR DIRECT.xml GATED.xml

Reads pytest's JUnit reports. For each LABEL, every test that passed in
DIRECT.xml must pass in GATED.xml, unless EXCEPTIONS names it: a line
"test|regex|why" (test as module.Class::name) says it must fail through
lockgate with a message the regex finds, a deliberate difference of
lockgate's (docs/behaviour.md). Prints per LABEL how many passed each way
and the names of what was lost; warns of exceptions no longer needed.

A library's own suite has tests that hang on timing (a sleep against a
lease, six workers on two shared cores), so a test may fail once in a run
either way. GATED.xml may be followed by reports of reruns of the tests it
lost (`--lost` names them): a test lost in the run but passing in every
rerun is reported as such ("passed N reruns") and is not lost. One failure
in any rerun, and it is lost.

`--lost` prints, one per line, the pytest node ids (under SUITE_DIR) of the
tests that passed in DIRECT.xml and not in GATED.xml, the exceptions left
out: what to rerun.

Exit status: 0 when nothing was lost beyond the exceptions, 1 otherwise.
"""

import os
import re
import sys
import xml.etree.ElementTree as ET


def results(path):
    """{test: (passed, failure message, node id parts)} of one JUnit report."""
    out = {}
    for case in ET.parse(path).iter("testcase"):
        test = f"{case.get('classname')}::{case.get('name')}"
        bad = case.find("failure")
        if bad is None:
            bad = case.find("error")
        skipped = case.find("skipped") is not None
        out[test] = (bad is None and not skipped, None if bad is None else bad.get("message", ""))
    return out


def node_id(test, suite_dir):
    """pytest's node id of `test` (module.Class::name) in `suite_dir`."""
    classname, name = test.split("::", 1)
    parts = classname.split(".")
    for i in range(len(parts), 0, -1):
        path = "/".join(parts[:i]) + ".py"
        if os.path.isfile(os.path.join(suite_dir, path)):
            return "::".join([path] + parts[i:] + [name])
    sys.exit(f"no module of {test} under {suite_dir}")


def read_exceptions(path):
    exceptions = {}
    for line in open(path):
        if line.strip():
            test, message, why = line.rstrip("\n").split("|", 2)
            exceptions[test] = (re.compile(message), why)
    return exceptions


def lost_in(direct, gated):
    baseline = sorted(t for t, (ok, _) in direct.items() if ok)
    return baseline, [t for t in baseline if not gated.get(t, (False, "did not run"))[0]]


def main(argv):
    if len(argv) == 6 and argv[1] == "--lost":
        exceptions = read_exceptions(argv[2])
        _, lost = lost_in(results(argv[4]), results(argv[5]))
        for test in lost:
            if test not in exceptions:
                print(node_id(test, argv[3]))
        return 0
    exceptions = read_exceptions(argv[1])
    runs = argv[2:]
    if not runs or len(runs) % 3:
        sys.exit(__doc__)
    failed = False
    excepted = set()
    for label, direct_xml, gated_xmls in zip(runs[0::3], runs[1::3], runs[2::3]):
        gated_xml, *rerun_xmls = gated_xmls.split(",")
        direct, gated = results(direct_xml), results(gated_xml)
        reruns = [results(x) for x in rerun_xmls]
        baseline, lost = lost_in(direct, gated)
        if not baseline:
            print(f"{label}: no test passed directly", file=sys.stderr)
            failed = True
            continue
        print(f"\n{label}: {len(baseline)} pass directly, {len(baseline) - len(lost)} through lockgate")
        for test in lost:
            message = gated.get(test, (False, "did not run"))[1] or ""
            first = message.splitlines()[0] if message else ""
            rule = exceptions.get(test)
            if rule and rule[0].search(message):
                print(f"    excepted ({rule[1]}): {test}: {first}")
                excepted.add(test)
            elif reruns and all(r.get(test, (False, ""))[0] for r in reruns):
                print(f"    failed once, passed {len(reruns)} reruns: {test}: {first}")
            else:
                print(f"    LOST: {test}: {first}")
                failed = True
    for test in sorted(set(exceptions) - excepted):
        print(f"warning: exception no longer needed (passes through lockgate or not directly): {test}",
              file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
