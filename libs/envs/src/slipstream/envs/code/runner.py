"""The grading runner: the program the grader runs in a sandbox, as `python3 -I -S -c RUNNER`.

It never lives in the agent's tree: the code is the `-c` argument and everything it needs (the
mode, the test sources, the arguments to call, a per-run secret nonce) arrives on stdin, read
whole before any of the agent's code is imported. `-I -S`: no PYTHON* variables, no user site,
no `site` (so no .pth, sitecustomize or usercustomize), and the script's directory is not on the
path; the tree (/work) is *appended* to sys.path only after the runner has imported what it
uses, so a `json.py` or `os.py` in the tree shadows nothing.

Reports go to a duplicate of the original stdout taken before the agent's code runs (fd 1 and
2 then both point at stderr, so whatever the agent prints is not a report); every report line
starts with the nonce, which the agent's code cannot read (see the audit hook below), so a
forged line is ignored. The runner ends with `os._exit(0)` right after its report: atexit
handlers and finalizers never run, and an exit before the report leaves no report (a zero).

Modes (`mode` in the payload):
- `record` (trusted: no agent code): loads the reference modules from the payload, runs the
  tests with the entry function wrapped to record each call's arguments and result by value,
  then calls the reference on `probes` perturbed copies of the recorded arguments (the hidden
  cases). Reports the calls, the probes and each test's outcome.
- `calls` (the agent's code): imports the agent's module from /work and calls its entry function
  on each argument list it is given; reports each result *by value* in a tagged literal of exact
  builtin types (a subclass of int, an object with its own `__eq__`: "not a plain value").
- `replay` (trusted): loads the reference modules with the entry function replaced by a lookup
  of the agent's results, runs the tests (HumanEval's `check`, the bugfix asserts): the asserts
  run in a process that never loaded the agent's code.
- `tests` (the agent's code, for repository tasks whose tests must call the package in-process):
  imports the agent's package, wraps the mutated module's functions so that a value whose type
  the patch defined is refused, loads the task's own test sources from the payload and runs them.

In the modes that load the agent's code an audit hook (which cannot be removed) refuses, and
reports at once, what could reach the runner's state or the report: frame access
(`sys._getframe`, `tb_frame`, `gi_frame`, ...), `gc`'s object walks, `ctypes`, signals, tracing,
forks and subprocesses, new audit hooks, opening anything under /proc, /sys or /dev/fd, and
writing, renaming or removing files outside /tmp. Any such event scores 0.
"""

RUNNER = r'''
def _main():
    import ast, builtins, os, random, sys, json
    # Every builtin the runner uses, as its own locals: the agent's code may rewrite the builtins module.
    _b = builtins.__dict__
    (zip, sorted, callable, getattr, hasattr, isinstance, str, tuple, dict, list, set, frozenset,
     int, float, bytes, bool, complex, type, compile, exec, __import__, len, any, repr, range,
     PermissionError, LookupError, RuntimeError, ValueError, Exception, BaseException,) = (
        _b[n] for n in """zip sorted callable getattr hasattr isinstance str tuple dict list set
        frozenset int float bytes bool complex type compile exec __import__ len any repr range
        PermissionError LookupError RuntimeError ValueError Exception BaseException""".split()
    )
    globals().pop("_main", None)
    payload = json.loads(sys.stdin.buffer.read())
    os.close(0)
    nonce = payload.pop("nonce")
    mode = payload["mode"]
    out = os.dup(1)
    os.dup2(2, 1)
    sys.dont_write_bytecode = True
    T, L, write, exit_, BE = type, len, os.write, os._exit, BaseException
    irepr, frepr, srepr, brepr = int.__repr__, float.__repr__, str.__repr__, bytes.__repr__
    join, append, items = str.join, list.append, dict.items
    flags_of = type.__dict__["__flags__"].__get__
    name_of = type.__dict__["__qualname__"].__get__
    NONE = T(None)
    SCALAR = {int: "i", float: "f", str: "s", bytes: "y", bool: "b"}

    class Bad(Exception):
        pass

    def enc(v, depth=0):
        t = T(v)
        if depth > 40:
            raise Bad("nested too deep")
        if t is NONE:
            return "('n',)"
        if t is bool:
            return "('b',True)" if v else "('b',False)"
        if t is int:
            return "('i'," + irepr(v) + ")"
        if t is float:
            return "('f'," + srepr(frepr(v)) + ")"
        if t is str:
            return "('s'," + srepr(v) + ")"
        if t is bytes:
            return "('y'," + brepr(v) + ")"
        if t is list or t is tuple or t is set or t is frozenset:
            tag = "l" if t is list else "t" if t is tuple else "S" if t is set else "F"
            parts = []
            for x in v:
                append(parts, enc(x, depth + 1))
            return "('" + tag + "',[" + join(",", parts) + "])"
        if t is dict:
            parts = []
            for k, x in items(v):
                append(parts, "(" + enc(k, depth + 1) + "," + enc(x, depth + 1) + ")")
            return "('d',[" + join(",", parts) + "])"
        raise Bad("not a plain value: " + name_of(t))

    def dec(node):
        tag = node[0]
        if tag == "n":
            return None
        if tag in ("i", "b", "s", "y"):
            return node[1]
        if tag == "f":
            return float(node[1])
        if tag == "l":
            return [dec(x) for x in node[1]]
        if tag == "t":
            return tuple(dec(x) for x in node[1])
        if tag == "S":
            return {dec(x) for x in node[1]}
        if tag == "F":
            return frozenset(dec(x) for x in node[1])
        if tag == "d":
            return {dec(k): dec(x) for k, x in node[1]}
        raise ValueError(f"bad tag {tag!r}")

    def report(kind, body):
        data = (nonce + " " + kind + " " + body + "\n").encode()
        while data:
            data = data[write(out, data):]

    def load(name, source):
        module = T(sys)(name)
        module.__file__ = "<" + name + ">"
        sys.modules[name] = module
        exec(compile(source, "<" + name + ">", "exec"), module.__dict__)
        return module

    def describe(exc):
        try:
            text = str(exc)
        except BE:
            text = "?"
        return name_of(T(exc)) + (": " + text[:200] if text else "")

    def run_tests(modules):
        found = []
        for name in modules:
            module = sys.modules[name]
            for attr in sorted(n for n in module.__dict__ if n.startswith("test_")):
                fn = module.__dict__[attr]
                if callable(fn):
                    append(found, (attr, fn))
        results = []
        for attr, fn in found:
            if mode in ("record", "replay"):
                random.seed(0)
            try:
                fn()
                append(results, (attr, True, ""))
            except BE as exc:
                append(results, (attr, False, describe(exc)))
        return results

    if mode in ("record", "replay"):
        for name, source in payload["modules"]:
            if name == payload["module"]:
                module = load(name, source)
                real = module.__dict__[payload["entry"]]
                inside = [False]
                replies = {k: ast.literal_eval(v) for k, v in payload.get("replies", {}).items()}

                def entry(*args, **kwargs):
                    key = enc((args, tuple(sorted(kwargs.items()))))
                    if mode == "replay":
                        reply = replies.get(key)
                        if reply is None:
                            raise LookupError("a call the recording did not make")
                        if reply[0] == "error":
                            raise RuntimeError("the patched function failed: " + reply[1])
                        return dec(reply[1])
                    if inside[0]:
                        return real(*args, **kwargs)
                    inside[0] = True
                    try:
                        result = real(*args, **kwargs)
                    finally:
                        inside[0] = False
                    calls[key] = enc(result)
                    return result

                calls = {}
                module.__dict__[payload["entry"]] = entry
            else:
                load(name, source)
        results = run_tests(payload["tests"])
        probes = {}
        if mode == "record" and payload.get("probes"):
            rng = random.Random(payload["probe_seed"])
            recorded = [ast.literal_eval(k) for k in calls]

            def shake(node):
                if node[0] == "i":
                    return ("i", node[1] + rng.randint(-25, 25))
                if node[0] in ("l", "t"):
                    return (node[0], [shake(x) for x in node[1]])
                return node

            for _ in range(payload["probes"] * 4):
                if L(probes) >= payload["probes"] or not recorded:
                    break
                args, kwargs = dec(shake(rng.choice(recorded)))
                key = enc((args, kwargs))
                if key in calls or key in probes:
                    continue
                try:
                    probes[key] = enc(real(*args, **dict(kwargs)))
                except BE:
                    continue
        for key in payload.get("extra", ()) if mode == "record" else ():
            args, kwargs = dec(ast.literal_eval(key))
            try:
                probes[enc((args, kwargs))] = enc(real(*args, **dict(kwargs)))
            except BaseException:
                continue
        report("result", enc({"tests": results, "calls": calls, "probes": probes}))
        exit_(0)

    # -- modes that load the agent's code --------------------------------------------------------
    import _thread
    spawn, new_lock, count = _thread.start_new_thread, _thread.allocate_lock, _thread._count
    calls_in = [(k, dec(ast.literal_eval(k))) for k in payload.get("calls", [])]
    blocked_imports = frozenset({"ctypes", "_ctypes", "gc", "signal", "_signal", "_posixsubprocess", "subprocess",
                       "multiprocessing", "_multiprocessing", "_testcapi", "_testinternalcapi",
                       "_xxsubinterpreters", "_xxinterpchannels", "faulthandler", "_tracemalloc", "tracemalloc"})
    for name in blocked_imports:
        sys.modules.pop(name, None)
    blocked_events = frozenset({"sys._current_frames", "sys._current_exceptions", "sys.settrace",
                      "sys.setprofile", "sys.addaudithook", "gc.get_objects", "gc.get_referrers",
                      "gc.get_referents", "os.fork", "os.forkpty", "os.exec", "os.posix_spawn", "os.spawn",
                      "os.system", "subprocess.Popen", "os.kill", "os.killpg", "ctypes.dlopen"})
    file_events = frozenset({"os.rename", "os.remove", "os.rmdir", "os.link", "os.symlink", "os.truncate",
                   "os.chmod", "os.chown", "os.mkdir", "shutil.rmtree", "shutil.copyfile", "shutil.move", "os.utime"})
    WRITE = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_APPEND
    seen = []
    fsdecode, sstr, startswith = os.fsdecode, str.__str__, str.startswith
    PRIVATE = ("/proc", "/sys", "/dev/fd", "/dev/mem")

    def refuse(what):
        # Recorded only: the main thread reports refusals after the agent's code has run, so this
        # hook (whose frames a traceback can reach) holds nothing of the report channel.
        if L(seen) < 8:
            append(seen, what)
        raise PermissionError("refused by the grader: " + what)

    def text(x):
        t = T(x)
        return sstr(x) if t is str or (t is not bytes and isinstance(x, str)) else fsdecode(x) if t is bytes else "?"

    def hook(event, args):
        if event in blocked_events:
            refuse(event)
        elif event in file_events:
            path = text(args[0])
            if not startswith(path, "/tmp"):
                refuse(event + " " + path)
        elif event == "import":
            if str.partition(text(args[0]), ".")[0] in blocked_imports:
                refuse("import " + text(args[0]))
        elif event == "open":
            path, how, flags = args
            path = text(path) if T(path) is not int else "fd"
            if startswith(path, PRIVATE):
                refuse("open " + path)
            writes = T(flags) is int and flags & WRITE
            if T(how) is str:
                for c in how:
                    if c in "wax+":
                        writes = True
            if writes and not startswith(path, "/tmp"):
                refuse("writing " + path)

    def isolated(job):
        """Run `job` in a fresh thread and wait; returns its result if an exact str, else "?", and
        whether another thread was still alive when it ended.

        The agent's code runs only in such threads: walking up the frames (sys._getframe, a
        traceback) ends at the thread's first frame and never reaches this function's caller (the
        nonce, the report channel); signals, which would run here with this frame, cannot be set
        up (the signal modules are refused). Only a str crosses back, so no object of the agent's
        (whose `__eq__` or `__del__` would run here) ever reaches this thread; the result sits in
        a closure cell, which the agent's code can read through a frame but not write."""
        done = new_lock()
        done.acquire()
        result, others = "?", 0

        def bottom():
            nonlocal result, others
            try:
                got = job()
                if T(got) is str:
                    result = got
            except BE:
                pass
            others = count() - 1
            done.release()

        spawn(bottom, ())
        done.acquire()
        return result, others

    FUNCTION, CODE = T(describe), T(describe.__code__)
    expected = {}
    for _, source in payload.get("modules", ()):
        for const in compile(source, "<test>", "exec").co_consts:
            if T(const) is CODE and const.co_name.startswith("test_"):
                expected[const.co_name] = const.co_code
    sys.addaudithook(hook)
    sys.path.append("/work")
    seen_builtins = dict(builtins.__dict__)
    if mode == "calls":
        module_name, entry_name = payload["module"], payload["entry"]

        def play():
            # In the agent's thread: results are encoded here, so only a str goes back.
            try:
                fn = getattr(__import__(module_name), entry_name)
            except BE as exc:
                return enc({"import": describe(exc)})
            out = {}
            for key, (args, kwargs) in calls_in:
                try:
                    value = fn(*args, **dict(kwargs))
                except BE as exc:
                    out[key] = "('error'," + srepr(describe(exc)) + ")"
                    continue
                try:
                    out[key] = "('ok'," + enc(value) + ")"
                except Bad as exc:
                    out[key] = "('error'," + srepr(exc.args[0]) + ")"
                value = None
            return enc(out)

        played, _ = isolated(play)
        for what in seen[:8]:
            report("refused", srepr(what if T(what) is str else "?"))
        report("result", played if played != "?" else enc({"import": "the run was cut short"}))
        exit_(0)

    # mode "tests": a package's own tests, in-process
    guard = payload["guard"]
    types_before = set()
    for m in list(sys.modules.values()):
        for v in list(getattr(m, "__dict__", {}).values()):
            if T(v) is type:
                types_before.add(v)
    types_before = frozenset(types_before)
    allowed_names = frozenset(guard["classes"])
    PLAIN = frozenset({int, float, str, bytes, bool, NONE, complex})
    spoiled = []

    def check(v, where, depth=0):
        t = T(v)
        if t in PLAIN or depth > 6:
            return v
        if t is list or t is tuple or t is set or t is frozenset:
            for x in v:
                check(x, where, depth + 1)
            return v
        if t is dict:
            for k, x in items(v):
                check(k, where, depth + 1)
                check(x, where, depth + 1)
            return v
        if flags_of(t) & 512 and t not in types_before and name_of(t) not in allowed_names:
            append(spoiled, where + " returned a " + name_of(t) + " (a type the patch defined)")
            raise Bad("a value of a type the patch defined: " + name_of(t))
        if hasattr(t, "__next__"):
            return checked(v, where)
        return v

    def checked(it, where):
        for x in it:
            yield check(x, where)

    def wrap(name, real):
        def guarded(*args, **kwargs):
            return check(real(*args, **kwargs), name)
        return guarded

    installed = []
    holder = [None]

    def setup():
        try:
            prepare()
        except BE as exc:
            return describe(exc) or "failed"
        return ""

    def prepare():
        package = __import__(guard["module"], fromlist=["*"])
        owners = [package] + [sys.modules[n] for n in guard["aliases"] if n in sys.modules]
        for name in guard["names"]:
            real = package.__dict__.get(name)
            if callable(real) and T(real) is not type:
                wrapped = wrap(name, real)
                for owner in owners:
                    if owner.__dict__.get(name) is real:
                        owner.__dict__[name] = wrapped
                        append(installed, (owner, name, wrapped))
        for name, source in payload["modules"]:
            load(name, source)
        found = []
        for name in payload["tests"]:
            for attr in sorted(n for n in sys.modules[name].__dict__ if n.startswith("test_")):
                fn = sys.modules[name].__dict__[attr]
                if callable(fn):
                    append(found, (sstr(attr), fn))
        holder[0] = tuple(found)

    def run_test(attr, fn):
        """In the agent's thread: one test, then whether the builtins and the guards are as they were."""
        try:
            fn()
            outcome = ""
        except BE as exc:
            outcome = describe(exc) or "failed"
        now = builtins.__dict__
        changed = [k for k in seen_builtins if k not in now or now[k] is not seen_builtins[k]]
        if changed:
            return "!builtins changed during " + attr + ": " + join(", ", sorted(changed)[:5])
        for owner, name, w in installed:
            if owner.__dict__.get(name) is not w:
                return "!the guard on " + name + " was replaced during " + attr
        if spoiled:
            return "!" + (spoiled[0] if T(spoiled[0]) is str else "?")
        return outcome

    def cells(fn):
        return (fn.__code__,) + tuple(c.cell_contents for c in (fn.__closure__ or ()))

    def same(a, b):  # identity only: == could run the agent's __eq__ here, in the main thread
        if L(a) != L(b):
            return False
        for x, y in zip(a, b):
            if x is not y:
                return False
        return True

    def intact(stage):
        """Main thread: no thread of the agent's left running, the runner's functions untouched."""
        for f, saved in pristine:
            if not same(cells(f), saved):
                append(seen, "the runner's checks were rewritten during " + stage)
                return False
        return True

    pristine = [(f, cells(f)) for f in (check, checked, wrap, run_test, describe)]
    why, others = isolated(setup)
    tests = holder[0]
    if others:
        append(seen, "the code under test left a thread running")
    if why != "" or T(tests) is not tuple:
        for what in seen[:8]:
            report("refused", srepr(what if T(what) is str else "?"))
        report("result", enc({"import": why or "the tests did not load"}))
        exit_(0)
    for entry in tests:
        # Each test must be one the task's sources define (its bytecode, compiled here before any of
        # the agent's code ran): a fake list of tests swapped in by a racing thread is refused.
        if T(entry) is not tuple or L(entry) != 2 or T(entry[1]) is not FUNCTION:
            append(seen, "a test the task does not define")
            break
        code = entry[1].__code__
        if T(code) is not CODE or T(code.co_code) is not bytes or code.co_code != expected.get(entry[0]):
            append(seen, "a test the task does not define: " + entry[0])
            break
    pristine += [(w, cells(w)) for _, _, w in installed]
    results = []
    for attr, fn in tests if not seen and intact("the import") else ():
        outcome, others = isolated(lambda attr=attr, fn=fn: run_test(attr, fn))
        if others:
            append(seen, "the code under test left a thread running after " + attr)
        if outcome.startswith("!"):
            append(seen, outcome[1:])
        append(results, (attr, outcome == "", outcome))
        if seen or not intact(attr):
            break
    for what in seen[:8]:
        report("refused", srepr(what if T(what) is str else "?"))
    report("result", enc({"tests": results}))
    exit_(0)


_main()
'''
