"""``python -m tapegrad.bench.gradbench [--trace]``: the GradBench tool protocol on
stdin/stdout (one JSON object per line)."""
import argparse
import importlib
import json
import sys
import time
import traceback

from . import EVALS


def evaluate(message, trace=False, M=None):
    """The response body for one ``evaluate`` message: ``success``, ``output`` and
    ``timings`` (a ``prepare`` entry when tracing, then one ``evaluate`` entry per run, as
    many as ``min_runs`` and ``min_seconds`` ask for; one run when the input has neither)."""
    if M is None:
        import tapegrad as M
    mod = importlib.import_module(f"{__package__}.{message['module']}")
    inp = message.get("input")
    timings = []
    t0 = time.perf_counter_ns()
    run, post = mod.prepare(message["function"], inp, M, trace)
    if trace:
        timings.append({"name": "prepare", "nanoseconds": time.perf_counter_ns() - t0})
    runs = seconds = 0
    if isinstance(inp, dict):
        runs, seconds = int(inp.get("min_runs", 1)), float(inp.get("min_seconds", 0))
    elapsed, n = 0, 0
    while True:
        start = time.perf_counter_ns()
        result = run()
        ns = time.perf_counter_ns() - start
        timings.append({"name": "evaluate", "nanoseconds": ns})
        elapsed += ns
        n += 1
        if n >= max(runs, 1) and elapsed >= seconds * 1e9:
            break
    return {"success": True, "output": post(result), "timings": timings}


def respond(message, trace=False, M=None):
    """The response (with its ``id``) to one message from an eval."""
    kind = message.get("kind")
    body = {}
    if kind == "start":
        body = {"tool": "tapegrad-trace" if trace else "tapegrad"}
    elif kind == "define":
        if message.get("module") in EVALS:
            body = {"success": True}
        else:
            body = {"success": False,
                    "error": f"tapegrad has no module {message.get('module')!r}; it has "
                             f"{', '.join(EVALS)}"}
    elif kind == "evaluate":
        try:
            body = evaluate(message, trace, M)
        except Exception as e:  # the eval reports it; the tool keeps serving
            body = {"success": False, "error": "".join(traceback.format_exception(e))}
    return {"id": message["id"]} | body


def serve(lines, write, trace=False, M=None):
    """Answer each JSON line of ``lines`` through ``write``; returns at end of input."""
    for line in lines:
        if not line.strip():
            continue
        write(json.dumps(respond(json.loads(line), trace, M)) + "\n")


def main(argv=None):
    parser = argparse.ArgumentParser(prog="python -m tapegrad.bench.gradbench",
                                     description=__doc__)
    parser.add_argument("--trace", action="store_true",
                        help="trace each objective once (timed as 'prepare') and replay it "
                             "in compiled code")
    parser.add_argument("--multithreaded", action="store_true",
                        help="accepted for GradBench's sake; tapegrad's eager mode is "
                             "single-threaded")
    args = parser.parse_args(argv)

    def write(s):
        sys.stdout.write(s)
        sys.stdout.flush()
    try:
        serve(sys.stdin, write, args.trace)
    except (BrokenPipeError, KeyboardInterrupt):
        pass


if __name__ == "__main__":
    main()
