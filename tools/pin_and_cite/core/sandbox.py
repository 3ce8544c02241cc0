"""The one Jinja environment note templates are parsed and rendered in, sandboxed: a template comes from a
contributor's branch, and `check` and the site build render it.

Jinja's ImmutableSandboxedEnvironment refuses every attribute that starts with `_` (so no way leads from a
value to its class, a function's globals, `os`), calls it deems unsafe, and methods that change a list, dict
or set (a note cannot empty `pins` to hide a stale pin from `check`). Jinja's own globals (`cycler`,
`lipsum`, `range`...) are removed: a template sees only the helpers the renderer gives it. Compiled templates
may be kept (CompiledTemplates): the checks run when a template runs, through calls Jinja compiles in only
for a sandboxed environment, so the folder is this environment's alone.
"""

from __future__ import annotations

import contextlib
import resource
import signal
import threading
from pathlib import Path

import jinja2
from jinja2 import nodes
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

MAX_SIZE = 1 << 20  # characters (or items) one `*` or `+` may make: a page is far smaller
MAX_POWER_BITS = 1 << 16  # bits one `**` or `*` of integers may make (9**(9**9) would take hours)
MAX_MEMORY = 1 << 30  # bytes of address space one page may add: a page is kilobytes
MAX_SECONDS = 5  # CPU seconds one page may take: the site's pages take milliseconds
MAX_STEPS = 100_000  # calls and loop turns one page may take; the site's 42 pages take 647 in all, 108 at most


class CompiledTemplates(jinja2.FileSystemBytecodeCache):
    """Templates compiled once and kept under the cache (`<cache>/<folder>/<Jinja version>/`): compiling every
    note is a third of a `check`. Jinja keys each file by the template's path and checks the hash of its
    source, so an edited template is compiled again; a damaged or unwritable file costs a compile, never an
    error. `folder` keeps environments apart: code compiled for the sandbox (the default, "jinja") is never
    loaded into another environment, nor the reverse."""

    def __init__(self, cache_root: Path, folder: str = "jinja"):
        folder = cache_root / folder / jinja2.__version__
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError:
            pass
        super().__init__(str(folder))

    def load_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().load_bytecode(bucket)
        except Exception:  # a damaged file: Jinja's own reader only survives some damage
            bucket.reset()

    def dump_bytecode(self, bucket: jinja2.bccache.Bucket) -> None:
        try:
            super().dump_bytecode(bucket)
        except OSError:
            pass


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, bounded in CPU and memory by the two kinds of hook Jinja gives it. Operators: `**`, `*`
    and `+` run through call_binop, which refuses a result larger than MAX_POWER_BITS or MAX_SIZE (the first
    two before it is computed: one C call that takes hours or 10 GB cannot be stopped halfway). Steps: every
    call (the environment's `call`) and every loop turn (each loop's iterable wrapped as the template is
    compiled) spends one of the page's MAX_STEPS, so an exponential macro or nested loops end in one line."""

    intercepted_binops = frozenset({"**", "*", "+"})
    steps_left = MAX_STEPS

    def call_binop(self, context, operator, left, right):
        if operator == "**" and _is_int(left) and _is_int(right) and right > 0:
            if abs(left).bit_length() * right > MAX_POWER_BITS:
                raise SecurityError(f"{left!r} ** {right!r} is too large (over {MAX_POWER_BITS} bits)")
        if operator == "*" and _is_int(left) and _is_int(right):
            if abs(left).bit_length() + abs(right).bit_length() > MAX_POWER_BITS:
                raise SecurityError(f"a product of integers is too large (over {MAX_POWER_BITS} bits)")
        if operator == "*":
            sized, times = (left, right) if _is_int(right) else (right, left)
            if _is_int(times) and isinstance(sized, (str, list, tuple)) and _weight(sized) * times > MAX_SIZE:
                raise SecurityError(f"a {type(sized).__name__} repeated {times!r} times is too large (over {MAX_SIZE})")
        result = super().call_binop(context, operator, left, right)
        if isinstance(result, (str, list, tuple)) and _weight(result) > MAX_SIZE:
            raise SecurityError(f"the result of {operator} is too large (over {MAX_SIZE})")
        return result

    def call(__self, __context, __obj, *args, **kwargs):
        __self.step()
        return super().call(__context, __obj, *args, **kwargs)

    def step(self) -> None:
        self.steps_left -= 1
        if self.steps_left < 0:
            raise SecurityError(f"the page takes more than {MAX_STEPS} calls and loop turns")

    def counted(self, iterable):
        for item in iterable:
            self.step()
            yield item

    def _generate(self, source: nodes.Template, name, filename, defer_init=False):
        for loop in source.find_all(nodes.For):
            loop.iter = nodes.Call(nodes.EnvironmentAttribute("counted"), [loop.iter], [], None, None)
        return super()._generate(source, name, filename, defer_init)


class BoundedTemplate(jinja2.Template):
    """A page: each render (not each include, which runs inside it) starts with MAX_STEPS, and runs under
    process limits (_limits) that catch what no hook sees: a filter or method sized by its argument
    (`center(10**9)`, `"%2000000000d"|format`, `s|replace("a", s)`), `~` doubling a string, a filter's
    work in each of many loop turns."""

    def render(self, *args, **kwargs) -> str:
        self.environment.steps_left = MAX_STEPS
        try:
            with _limits():
                return super().render(*args, **kwargs)
        except MemoryError as exc:
            where = exc.__traceback__  # the template's frames, for the line the error names
            raise SecurityError(f"the page needs more than {MAX_MEMORY >> 20} MiB").with_traceback(where) from None


@contextlib.contextmanager
def _limits():
    """For the render: at most MAX_MEMORY more address space (RLIMIT_AS, so an allocation past it is a
    MemoryError, not the machine's memory) and MAX_SECONDS of CPU (SIGPROF, where signals can be had: the
    main thread). Both are put back as they were after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        in_use = int(Path("/proc/self/statm").read_text().split()[0]) * resource.getpagesize()
        cap = min(limit for limit in (soft, hard, in_use + MAX_MEMORY) if limit != resource.RLIM_INFINITY)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (OSError, ValueError):  # no /proc (macOS), or a limit the system will not set: CPU only
        pass
    timed = threading.current_thread() is threading.main_thread()
    if timed:
        handler = signal.signal(signal.SIGPROF, _out_of_time)
        timer = signal.setitimer(signal.ITIMER_PROF, MAX_SECONDS)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_PROF, *timer)
            signal.signal(signal.SIGPROF, handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _out_of_time(signum, frame):
    raise SecurityError(f"the page takes more than {MAX_SECONDS} s of CPU")


def _is_int(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _weight(value: str | list | tuple) -> int:
    """What `value` costs to hold or print: its length, plus the length of each string or sequence in it
    (`[s] * n` is as large as `s * n` once joined)."""
    if isinstance(value, str):
        return len(value)
    return len(value) + sum(len(item) for item in value if isinstance(item, (str, list, tuple)))


def environment(
    loader: jinja2.BaseLoader | None = None, compiled: CompiledTemplates | None = None
) -> BoundedEnvironment:
    env = BoundedEnvironment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
        bytecode_cache=compiled,
    )
    env.template_class = BoundedTemplate
    env.globals.clear()
    return env
