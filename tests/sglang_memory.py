"""SGLang's /release_memory_occupation and /resume_memory_occupation, read from its source (a
tests/sglang_source.py Source): the tags, how the scheduler takes a request, and the success
reply that is no reply at all (the handler falls off its end: FastAPI answers 200, `null`).

    memory_tags(src)                                  # ['kv_cache', 'weights', 'cuda_graph']
    memory_step(src, "release_memory_occupation")     # MemoryStep(idle_check='self.is_fully_idle()', ...)
    answers_null(src, "/release_memory_occupation")   # True
"""

from __future__ import annotations

import ast
from dataclasses import dataclass

from sglang_http import falls_through
from sglang_source import SCHEDULER_WEIGHT_UPDATER, Source, functions

CONSTANTS = "sglang/srt/constants.py"
ROUTES = ("/release_memory_occupation", "/resume_memory_occupation")


@dataclass(frozen=True)
class MemoryStep:
    """How the scheduler's release_memory_occupation or resume_memory_occupation takes a request
    (managers/scheduler_components/weight_updater.py), each part unparsed, None where it has none."""

    idle_check: str | None  # the test of the `assert <test>, message` the function opens with
    idle_message: str | None
    all_tags_when: str | None  # the test under which `tags = GPU_MEMORY_ALL_TYPES`
    bookkeeping: str | None  # the call that records each tag: self.offload_tags.add(tag) or .remove(tag)


def answers_null(src: Source, path: str, method: str | None = None) -> bool:
    """The route's handler can fall off its end: FastAPI answers that with 200 and a JSON `null`."""
    return falls_through(src.handler(path, method).body)


def memory_tags(src: Source) -> list[str]:
    """GPU_MEMORY_ALL_TYPES of sglang/srt/constants.py, its names resolved to their strings: the
    tags a release names, and what tags null (or []) stands for."""
    tree = src.module(CONSTANTS)
    strings = {t.id: node.value.value for node in tree.body if isinstance(node, ast.Assign)
               and isinstance(node.value, ast.Constant) for t in node.targets if isinstance(t, ast.Name)}
    for node in tree.body:
        if isinstance(node, ast.Assign) and [ast.unparse(t) for t in node.targets] == ["GPU_MEMORY_ALL_TYPES"]:
            return [strings[e.id] if isinstance(e, ast.Name) else ast.literal_eval(e) for e in node.value.elts]
    raise LookupError(f"{src.root}: no GPU_MEMORY_ALL_TYPES in {CONSTANTS}")


def memory_step(src: Source, name: str) -> MemoryStep:
    """`name` (release_memory_occupation or resume_memory_occupation) as the scheduler runs it."""
    found = list(functions(src.module(SCHEDULER_WEIGHT_UPDATER), name))
    if len(found) != 1:
        raise LookupError(f"{src.root}: {len(found)} {name} in {SCHEDULER_WEIGHT_UPDATER}")
    func = found[0]
    check = next((s for s in func.body if isinstance(s, ast.Assert)), None)
    message = check.msg.value if check is not None and isinstance(check.msg, ast.Constant) else None
    all_tags = next((ast.unparse(n.test) for n in ast.walk(func) if isinstance(n, ast.If)
                     and any(ast.unparse(s) == "tags = GPU_MEMORY_ALL_TYPES" for s in n.body)), None)
    record = next((ast.unparse(n) for n in ast.walk(func) if isinstance(n, ast.Call)
                   and ast.unparse(n.func).startswith("self.offload_tags.")), None)
    return MemoryStep(ast.unparse(check.test) if check is not None else None, message, all_tags, record)
