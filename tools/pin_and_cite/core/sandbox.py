"""The one Jinja environment note templates are parsed and rendered in, sandboxed: a template comes from a
contributor's branch, and `check` and the site build render it.

Jinja's ImmutableSandboxedEnvironment refuses every attribute that starts with `_` (so no way leads from a
value to its class, a function's globals, `os`), calls it deems unsafe, and methods that change a list, dict
or set (a note cannot empty `pins` to hide a stale pin from `check`). Jinja's own globals (`cycler`,
`lipsum`, `range`...) are removed: a template sees only the helpers the renderer gives it. Jinja's bytecode
cache is never used (it unpickles its files, and a cache a branch can reach would run the branch's code);
pin_and_cite.core.compiled_templates keeps the generated Python text, verified, outside every checkout.

Every page is compiled and rendered within `bounded()`: Jinja folds constant filters while it compiles, so a
bound on the render alone let `"%2000000000d"|format(1)` cost a `check` 176 s and 9.8 GB. One environment
serves one run (a check, a render, a site build), whose pages and note rules share MAX_RUN_SECONDS of CPU.
"""

from __future__ import annotations

import contextlib
import functools
import os
import re
import resource
import signal
import threading
import time

import jinja2
from jinja2 import nodes
from jinja2.debug import rewrite_traceback_stack
from jinja2.sandbox import ImmutableSandboxedEnvironment, SecurityError

from pin_and_cite.core.errors import PinAndCiteError

MAX_POWER_BITS = 1 << 16  # bits one `**` or `*` of integers may make (9**(9**9) would take hours)
MAX_MEMORY = 1 << 30  # bytes of address space one page may add: a page is kilobytes
MAX_SECONDS = 5  # CPU seconds one page may take: the site's pages take milliseconds
MAX_RUN_SECONDS = 20  # CPU seconds all the pages of one check, render or site build may take: the site's take 1
MAX_STEPS = 100_000  # calls and loop turns one page may take; the site's 42 pages take 647 in all, 108 at most
MAX_TEXT = 1 << 24  # a width or count a filter or string method may be given (center(10**9)): a page is kilobytes
SIZED_FILTERS = ("center", "indent", "wordwrap", "format", "batch", "slice", "replace")  # output sized by an argument
_WIDTH = re.compile(r"[%:.](?:.?[<>=^])?[-#0 +]*(\d+)")  # a width or precision in a format string


class RunOverBudget(PinAndCiteError):
    """The pages of one run (check, render, a site build) spent MAX_RUN_SECONDS together: the run stops."""


class BoundedEnvironment(ImmutableSandboxedEnvironment):
    """The sandbox, bounded in CPU and memory. Integer `**` and `*` run through call_binop, which refuses a
    result over MAX_POWER_BITS before computing it (9**(9**9) is one C call of hours: no limit can stop it
    halfway), and a string or list repeated past MAX_TEXT. Every call (the environment's `call`) and every loop
    turn (each loop's iterable wrapped as the template is compiled) spends one of the page's MAX_STEPS, so an
    exponential macro or nested loops end at once with a line that says why. A filter or string method given
    a width or count over MAX_TEXT (`"%2000000000d"|format(1)`, `center(10**9)`) is refused before it runs,
    so Jinja's constant folding, which calls filters while compiling, cannot make it either. The rest, memory
    above all, is left to the limits of `bounded()`, which hold the compile as well as the render of a page."""

    intercepted_binops = frozenset({"**", "*"})
    steps_left = MAX_STEPS
    seconds_left = MAX_RUN_SECONDS
    compiling = False
    _inside = False

    def call_binop(self, context, operator, left, right):
        if _is_int(left) and _is_int(right):
            bits = left.bit_length() * max(right, 0) if operator == "**" else left.bit_length() + right.bit_length()
            if bits > MAX_POWER_BITS:
                raise SecurityError(f"an integer {operator} is too large (over {MAX_POWER_BITS} bits)")
        elif operator == "*":
            times, value = (left, right) if _is_int(left) else (right, left)
            if _is_int(times) and isinstance(value, (str, list, tuple)) and len(value) * times > MAX_TEXT:
                raise SecurityError(f"a repeat needs more than {MAX_TEXT} characters or items")
        return super().call_binop(context, operator, left, right)

    def call(__self, __context, __obj, *args, **kwargs):
        __self.step()
        if isinstance(getattr(__obj, "__self__", None), str):  # "a".center(10**9), "a".ljust(10**9)
            _refuse_sizes(__obj.__name__, (__obj.__self__, *args), kwargs)
        return super().call(__context, __obj, *args, **kwargs)

    def wrap_str_format(self, value):
        """The sandbox's str.format, refusing a width over MAX_TEXT in its format string first."""
        formats = super().wrap_str_format(value)
        if formats is None:
            return None

        def bounded_format(*args, **kwargs):
            _refuse_sizes(value.__name__, (value.__self__, *args), kwargs)
            return formats(*args, **kwargs)

        return bounded_format

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
        self.compiling = True  # a SIZED_FILTERS filter is not folded: it runs in the render, where lines are known
        try:
            return super()._generate(source, name, filename, defer_init)
        finally:
            self.compiling = False

    @contextlib.contextmanager
    def bounded(self):
        """One page's bounds, around its compile and its render (an include inside it shares them): MAX_STEPS,
        and MAX_SECONDS of CPU but no more than the run has left, with MAX_MEMORY more address space."""
        if self._inside:
            yield
            return
        seconds = min(MAX_SECONDS, self.seconds_left)
        if seconds <= 0:
            raise RunOverBudget(f"the pages of this run take more than {MAX_RUN_SECONDS} s of CPU in all")
        if seconds < MAX_SECONDS:
            spent = RunOverBudget(f"the pages of this run take more than {MAX_RUN_SECONDS} s of CPU in all")
        else:
            spent = SecurityError(f"the page takes more than {MAX_SECONDS} s of CPU")
        self.steps_left, self._inside, start = MAX_STEPS, True, time.process_time()
        try:
            with _limits(seconds):
                yield
        except _OutOfTime:
            where = rewrite_traceback_stack().__traceback__  # template lines, as Jinja gives its own errors
            raise spent.with_traceback(where) from None
        except MemoryError as exc:
            where = exc.__traceback__  # the template's frames, for the line the error names
            raise SecurityError(f"the page needs more than {MAX_MEMORY >> 20} MiB").with_traceback(where) from None
        finally:
            self._inside = False
            self.seconds_left -= time.process_time() - start


class BoundedTemplate(jinja2.Template):
    """A page: each render (not each include, which runs inside it) runs within the environment's bounds
    (`bounded()`), for what no hook sees: `"a" * 10**9` within MAX_TEXT but in every loop turn, a filter's
    work in each of many loop turns, `~` doubling a string."""

    def render(self, *args, **kwargs) -> str:
        with self.environment.bounded():
            return super().render(*args, **kwargs)


class _OutOfTime(BaseException):
    """The CPU timer's: not an Exception, which Jinja's constant folding would take for "not a constant" and
    swallow, nor one a helper's `except Exception` could turn into its own error."""


def _out_of_time(signum, frame):
    raise _OutOfTime


@contextlib.contextmanager
def _limits(seconds: float):
    """At most MAX_MEMORY more address space (RLIMIT_AS, so an allocation past it is a MemoryError, not the
    machine's memory) and `seconds` of CPU (SIGPROF, where signals can be had: the main thread, raising
    _OutOfTime). Both limits are put back as they were after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    try:
        in_use = _pages_mapped() * resource.getpagesize()
        cap = min(limit for limit in (soft, hard, in_use + MAX_MEMORY) if limit != resource.RLIM_INFINITY)
        resource.setrlimit(resource.RLIMIT_AS, (cap, hard))
    except (OSError, ValueError):  # no /proc (macOS), or a limit the system will not set: CPU only
        pass
    timed = threading.current_thread() is threading.main_thread()
    if timed:
        handler = signal.signal(signal.SIGPROF, _out_of_time)
        timer = signal.setitimer(signal.ITIMER_PROF, seconds)
    try:
        yield
    finally:
        if timed:
            signal.setitimer(signal.ITIMER_PROF, *timer)
            signal.signal(signal.SIGPROF, handler)
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def _pages_mapped() -> int:
    """This process's address space in pages, the first field of /proc/self/statm, read with one os.read: it is
    read for the bounds of every page and every note's rules (through pathlib, a few percent of a `check`)."""
    fd = os.open("/proc/self/statm", os.O_RDONLY)
    try:
        return int(os.read(fd, 4096).split()[0])
    finally:
        os.close(fd)


def _refuse_sizes(name: str, args, kwargs) -> None:
    """Refuse a width or count over MAX_TEXT given to the filter or string method `name` as an argument, or,
    for `format`, written in its format string, its first argument (`%2000000000d`, `{:*>2000000000}`), whose
    other arguments are values to show, not sizes, unless the string takes its width from them (`%*d`)."""
    values = (*args, *kwargs.values())
    if name in ("format", "format_map") and args and isinstance(args[0], str):
        sizes = [int(d) if len(d) < 12 else MAX_TEXT + 1 for d in _WIDTH.findall(args[0])]
        sizes += [v for v in values if _is_int(v)] if "*" in args[0] else []
    else:
        sizes = [value for value in values if _is_int(value)]
    if any(size > MAX_TEXT for size in sizes):
        raise SecurityError(f"{name}() needs more than {MAX_TEXT} characters or items")


def _sized(env: BoundedEnvironment, name: str, function):
    """The filter `function`, refusing a width or count over MAX_TEXT before it runs, and to run while the
    page compiles (Jinja's constant folding takes the error for "not a constant")."""

    @functools.wraps(function)  # keeps jinja_pass_arg: an environment or eval-context filter stays one
    def bounded_filter(*args, **kwargs):
        if env.compiling:
            raise SecurityError(f"{name}() runs in the render, not the compile")
        _refuse_sizes(name, args, kwargs)
        return function(*args, **kwargs)

    return bounded_filter


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
    env.seconds_left = MAX_RUN_SECONDS  # the run's: one environment serves one check, render or build
    env.globals.clear()
    env.filters.update({name: _sized(env, name, env.filters[name]) for name in SIZED_FILTERS})
    return env
