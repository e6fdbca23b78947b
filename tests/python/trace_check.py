#!/usr/bin/env python3
"""trace_check.py: checks a Chrome trace-event / Perfetto JSON file (what `tilewave trace`
writes, docs/trace.md) against the trace-event format, with the standard library only.

Checks: the file is JSON, either an object with a "traceEvents" list or a bare list of events;
every event has name, ph, ts, pid and tid of the right types; ph is one of the format's phases;
complete events (X) have dur >= 0; B/E events are balanced per thread (an E closes the innermost
open B of its thread, with the same name where it gives one); metadata events (M) are
process_name / thread_name (with args.name a string) or process_sort_index / thread_sort_index
(with args.sort_index an integer) or process_labels; instant events have a scope in {g, p, t}.
Beyond the format, what Perfetto needs to draw a track without "unnestable slice" errors: the
X events of one thread nest (each one ends before its parent does) and every thread and process
with events is named by an M event. Options add requirements on the content:
  --require-name N     an event named N exists (repeatable)
  --require-thread T   a thread is named T (repeatable)
  --require-meta K     the top-level "metadata" object has key K (repeatable)
  --min-events N       at least N events that are not metadata

`trace_check.py --self-test` feeds every rule a file that breaks it.

Exit status 0 when the file passes, 1 when it does not (every problem printed, at most 50), 2 on
a usage error.
"""
import argparse
import json
import numbers
import sys

PHASES = set("BEXiIMCbenstfPOND") | {"(", ")"}
META_NAMES = {"process_name", "thread_name", "process_sort_index", "thread_sort_index",
              "process_labels"}
EPS_US = 1e-6  # timestamps are microseconds written with 3 decimals: compare with slack


def is_num(v):
    return isinstance(v, numbers.Real) and not isinstance(v, bool)


def is_int(v):
    return isinstance(v, int) and not isinstance(v, bool)


def check(doc, args):
    errors = []

    def err(msg):
        errors.append(msg)

    if isinstance(doc, list):
        events, top = doc, {}
    elif isinstance(doc, dict) and isinstance(doc.get("traceEvents"), list):
        events, top = doc["traceEvents"], doc
    else:
        return ["the file is neither a list of events nor an object with a traceEvents list"]
    if "displayTimeUnit" in top and top["displayTimeUnit"] not in ("ms", "ns"):
        err("displayTimeUnit %r is not ms or ns" % (top["displayTimeUnit"],))

    named_threads, named_procs = {}, set()
    used_threads, used_procs = set(), set()
    open_b = {}  # (pid, tid) -> [names of open B events]
    spans = {}  # (pid, tid) -> [(ts, dur, index)]
    names = set()
    ordinary = 0
    for i, e in enumerate(events):
        where = "event %d" % i
        if not isinstance(e, dict):
            err("%s is not an object" % where)
            continue
        missing = [k for k in ("name", "ph", "ts", "pid", "tid") if k not in e]
        if missing:
            err("%s lacks %s" % (where, ", ".join(missing)))
            continue
        ph, name = e["ph"], e["name"]
        if not isinstance(name, str):
            err("%s: name is not a string" % where)
        if ph not in PHASES:
            err("%s: ph %r is not a trace-event phase" % (where, ph))
            continue
        if not is_num(e["ts"]):
            err("%s: ts is not a number" % where)
            continue
        if not (is_int(e["pid"]) or isinstance(e["pid"], str)) or \
           not (is_int(e["tid"]) or isinstance(e["tid"], str)):
            err("%s: pid and tid must be integers (or strings)" % where)
            continue
        key = (e["pid"], e["tid"])
        a = e.get("args", {})
        if not isinstance(a, dict):
            err("%s: args is not an object" % where)
            a = {}
        names.add(name)
        if ph == "M":
            if name not in META_NAMES:
                err("%s: metadata event %r is not one of %s" % (where, name, sorted(META_NAMES)))
            elif name.endswith("_name") and not isinstance(a.get("name"), str):
                err("%s: %s needs args.name (a string)" % (where, name))
            elif name.endswith("_sort_index") and not is_int(a.get("sort_index")):
                err("%s: %s needs args.sort_index (an integer)" % (where, name))
            if name == "thread_name" and isinstance(a.get("name"), str):
                if key in named_threads:
                    err("%s: thread %r named twice" % (where, key))
                named_threads[key] = a["name"]
            if name == "process_name":
                named_procs.add(e["pid"])
            continue
        ordinary += 1
        used_threads.add(key)
        used_procs.add(e["pid"])
        if ph == "X":
            d = e.get("dur")
            if not is_num(d):
                err("%s (%s): X event without a numeric dur" % (where, name))
            elif d < 0:
                err("%s (%s): dur %r < 0" % (where, name, d))
            else:
                spans.setdefault(key, []).append((float(e["ts"]), float(d), i, name))
        elif ph == "B":
            open_b.setdefault(key, []).append(name)
        elif ph == "E":
            stack = open_b.get(key, [])
            if not stack:
                err("%s: E on thread %r with no open B" % (where, key))
            else:
                top_name = stack.pop()
                if name and top_name and name != top_name:
                    err("%s: E %r closes B %r on thread %r" % (where, name, top_name, key))
        elif ph in ("i", "I"):
            if "s" in e and e["s"] not in ("g", "p", "t"):
                err("%s: instant scope %r is not g, p or t" % (where, e["s"]))
    for key, stack in open_b.items():
        if stack:
            err("thread %r: %d B event(s) never closed (%s)" % (key, len(stack), stack[-1]))
    # X events of one thread: sorted by start (longer first at equal starts), each must end
    # before the innermost open one does.
    for key, xs in spans.items():
        xs.sort(key=lambda s: (s[0], -s[1], s[2]))
        stack = []
        for ts, d, i, name in xs:
            while stack and ts >= stack[-1][0] - EPS_US:
                stack.pop()
            if stack and ts + d > stack[-1][0] + EPS_US:
                err("thread %r: X event %d (%s, %.3f + %.3f) overlaps its parent %s without "
                    "nesting" % (key, i, name, ts, d, stack[-1][1]))
            stack.append((ts + d, name))
    for key in sorted(used_threads - set(named_threads), key=str):
        err("thread %r has events but no thread_name" % (key,))
    for pid in sorted(used_procs - named_procs, key=str):
        err("process %r has events but no process_name" % (pid,))
    for n in args.require_name:
        if n not in names:
            err("no event named %r" % n)
    thread_labels = set(named_threads.values())
    for t in args.require_thread:
        if t not in thread_labels:
            err("no thread named %r" % t)
    meta = top.get("metadata")
    for k in args.require_meta:
        if not isinstance(meta, dict) or k not in meta:
            err("the metadata object has no %r" % k)
    if ordinary < args.min_events:
        err("%d events, fewer than %d" % (ordinary, args.min_events))
    if not errors:
        print("trace ok: %d events on %d threads of %d processes" %
              (ordinary, len(used_threads), len(used_procs)))
    return errors


def self_test():
    """Every rule rejects a file that breaks it, and a good file passes: the checks are real."""
    opts = argparse.Namespace(require_name=[], require_thread=[], require_meta=[], min_events=0)
    names = [{"name": "process_name", "ph": "M", "pid": 0, "tid": 0, "ts": 0,
              "args": {"name": "rank 0"}},
             {"name": "thread_name", "ph": "M", "pid": 0, "tid": 1, "ts": 0,
              "args": {"name": "producer CTA 0"}}]

    def ev(**kw):
        e = {"name": "tile", "ph": "X", "pid": 0, "tid": 1, "ts": 1.0, "dur": 2.0}
        e.update(kw)
        return e

    good = names + [ev(), ev(name="inner", ts=1.5, dur=0.5), ev(ts=3.0, dur=0.0),
                    ev(ph="B", name="b", ts=4.0), ev(ph="E", name="b", ts=5.0),
                    ev(ph="i", name="announce", s="t", ts=4.5)]
    bad = {
        "missing ts": names + [{"name": "tile", "ph": "X", "pid": 0, "tid": 1, "dur": 1}],
        "unknown phase": names + [ev(ph="Q")],
        "negative dur": names + [ev(dur=-1.0)],
        "X without dur": names + [{"name": "t", "ph": "X", "pid": 0, "tid": 1, "ts": 0}],
        "open B": names + [ev(ph="B", name="b")],
        "E without B": names + [ev(ph="E", name="b")],
        "E closing another B": names + [ev(ph="B", name="a"), ev(ph="E", name="b", ts=2)],
        "X not nested": names + [ev(), ev(ts=2.0, dur=2.0)],
        "thread_name without name": [names[0], {"name": "thread_name", "ph": "M", "pid": 0,
                                                "tid": 1, "ts": 0, "args": {}}] + [ev()],
        "unknown metadata": names + [{"name": "colour", "ph": "M", "pid": 0, "tid": 1, "ts": 0,
                                      "args": {}}],
        "unnamed thread": names + [ev(tid=7)],
        "unnamed process": names + [ev(pid=3, tid=1)],
        "bad instant scope": names + [ev(ph="i", s="x")],
        "not a trace": {"events": []},
    }
    failed = 0
    if check({"traceEvents": good, "metadata": {}}, opts):
        print("self-test: the good trace was rejected")
        failed += 1
    for what, doc in bad.items():
        if not check({"traceEvents": doc} if isinstance(doc, list) else doc, opts):
            print("self-test: %s was accepted" % what)
            failed += 1
    strict = argparse.Namespace(require_name=["nothing"], require_thread=[],
                                require_meta=["ranks"], min_events=99)
    if len(check({"traceEvents": good}, strict)) != 3:
        print("self-test: --require-name / --require-meta / --min-events not all enforced")
        failed += 1
    print("self-test: %d of %d rules checked, %d failed" % (len(bad) + 2, len(bad) + 2, failed))
    return 1 if failed else 0


def main():
    if sys.argv[1:] == ["--self-test"]:
        return self_test()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("file")
    p.add_argument("--require-name", action="append", default=[])
    p.add_argument("--require-thread", action="append", default=[])
    p.add_argument("--require-meta", action="append", default=[])
    p.add_argument("--min-events", type=int, default=0)
    args = p.parse_args()
    try:
        with open(args.file, encoding="utf-8") as f:
            doc = json.load(f)
    except (OSError, ValueError) as e:
        print("%s: not readable as JSON: %s" % (args.file, e))
        return 1
    errors = check(doc, args)
    for m in errors[:50]:
        print("%s: %s" % (args.file, m))
    if len(errors) > 50:
        print("%s: ... and %d more" % (args.file, len(errors) - 50))
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
