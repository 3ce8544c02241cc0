"""The one Jinja environment note templates are parsed and rendered in, sandboxed: a template comes from a
contributor's branch, and `check` and the site build render it.

Jinja's ImmutableSandboxedEnvironment refuses every attribute that starts with `_` (so no way leads from a
value to its class, a function's globals, `os`), calls it deems unsafe, and methods that change a list, dict
or set (a note cannot empty `pins` to hide a stale pin from `check`). Jinja's own globals (`cycler`,
`lipsum`, `range`...) are removed: a template sees only the helpers the renderer gives it. Jinja's bytecode
cache is never used (it unpickles its files, and a cache a branch can reach would run the branch's code);
pin_and_cite.core.compiled_templates keeps the generated Python text, verified, outside every checkout.
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

MAX_POWER_BITS = 1 << 16  # bits one `**` or `*` of integers may make (9**(9**9) would take hours)
MAX_MEMORY = 1 << 30  # bytes of address space one page may add: a page is kilobytes
MAX_SECONDS = 5  # CPU seconds one page may take: the site's pages take milliseconds
MAX_STEPS = 100_000  # calls and loop turns one page may take; the site's 42 pages take 647 in all, 108 at most


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, bounded in CPU and memory. Integer `**` and `*` run through call_binop, which refuses a
    result over MAX_POWER_BITS before computing it (9**(9**9) is one C call of hours: no limit can stop it
    halfway). Every call (the environment's `call`) and every loop turn (each loop's iterable wrapped as the
    template is compiled) spends one of the page's MAX_STEPS, so an exponential macro or nested loops end
    at once with a line that says why. The rest, memory above all, is left to BoundedTemplate's limits."""

    intercepted_binops = frozenset({"**", "*"})
    steps_left = MAX_STEPS

    def call_binop(self, context, operator, left, right):
        if _is_int(left) and _is_int(right):
            bits = left.bit_length() * max(right, 0) if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_POWER_BITS:
                raise SecurityError(f"an integer {operator} is too large (over {MAX_POWER_BITS} bits)")
        return super().call_binop(context, operator, left, right)

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
    process limits (_limits) for what no hook sees: `"a" * 10**10`, a filter or method sized by its argument
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


def environment(loader: jinja2.BaseLoader | None = None) -> BoundedEnvironment:
    env = BoundedEnvironment(
        loader=loader,
        undefined=jinja2.StrictUndefined,
        keep_trailing_newline=True,
        autoescape=False,
    )
    env.template_class = BoundedTemplate
    env.globals.clear()
    return env
