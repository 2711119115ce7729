"""Compiling grammars off the engine loop: the dead-rule analysis (pure), and the grammar service
with its real worker processes on the SmolLM2 tokenizer: time, memory, size and queue limits, a
compiler crash contained in its worker, the checks on what xgrammar would drop or can never end,
and the cache. The same over HTTP: test_structured_api.py, test_structured_fuzz.py."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import threading
from collections.abc import Iterator
from typing import Any

import pytest

from kvpilot.runtime.grammar.analysis import find_dead_rule
from kvpilot.runtime.grammar.service import GrammarLimits, GrammarQueueFullError, GrammarService
from kvpilot.runtime.grammar.structured_output import (
    GrammarCompiler,
    GuidedSpec,
    GuidedSpecError,
    LazyGrammarCompiler,
)
from kvpilot.runtime.grammar.worker import _MEMORY, _NO_ANSWER, VetThread
from kvpilot.runtime.load.loader import builtin_model_path
from kvpilot.runtime.load.tokenizer import Tokenizer

pytestmark = pytest.mark.timeout(300)


def many_optional(n: int) -> GuidedSpec:
    """The user's stall: an object of n optional integer properties (cost grows ~n^2.5)."""
    props = {f"p{i}": {"type": "integer"} for i in range(n)}
    return GuidedSpec.json_schema({"type": "object", "properties": props}, "guided_json")


SMALL = GuidedSpec.json_schema({"type": "object", "properties": {"a": {"type": "integer"}}}, "guided_json")

# -- the dead-rule analysis (pure) ----------------------------------------------------------------

EMPTY_CLASS = r"[^\f\n\r\t\v \xa0\u1680\u2000-\u200a\u2028\u2029\u202f\u205f\u3000\ufeff\0-\b\x0e-\x1f!-\x9f\xa1-\u167f\u1681-\u1fff\u200b-\u2027\u202a-\u202e\u2030-\u205e\u2060-\u2fff\u3001-\ufefe\uff00-\U0010ffff]"


@pytest.mark.parametrize(
    ("ebnf", "dead"),
    [
        ("root ::= ((root))", ("root", True)),
        (f'root ::= (("a" {EMPTY_CLASS}))', ("root", True)),  # xgrammar's print of regex a[^\s\S]
        ('root ::= (("a" root))', ("root", True)),  # only infinite strings
        ('root ::= (("a" x) | ("b"))\nx ::= ((x))', ("x", False)),  # a dead branch
        (r'root ::= (("{" "\"a\"" ": " root_prop_0 "}"))' + "\nroot_prop_0 ::= ((root))", ("root", True)),
        ('root ::= (("a" x*))\nx ::= ((x))', ("x", False)),  # reachable, though optional
        ('root ::= (("a" [])) | ("b")', None),  # whole line is one rule body: "b" finishes it
        ('root ::= (("a" root) | ("b"))', None),
        ('root ::= (("[" item{0, -1} "]"))\nitem ::= (([0-9]+) | ("[" item "]"))', None),
        (
            r'root ::= (("\"" s))' + "\n" + r's ::= (("\"") | ([^\0-\x1f\"\\] s)) (=([ \n\r\t]* [,}\]:]))',
            None,
        ),
        ('root ::= (("x" r))\nr ::= Regex("^[a-z]+$", json_string=true)', None),
        ("root ::= ((undefined_rule))", None),  # not a grammar xgrammar would print: no verdict
        ('root ::= TagDispatch(("a", x))', None),  # a construct the analysis does not model
        (r"root ::= (([^\p{L}]))", None),  # an escape it does not model: never called empty
        ("root ::= (([^\\0-\\U0010ffff]))", ("root", True)),
        ("root ::= (([]))", ("root", True)),
    ],
)
def test_dead_rules(ebnf: str, dead: tuple[str, bool] | None) -> None:
    found = find_dead_rule(ebnf)
    assert (None if found is None else (found.rule, found.is_root)) == dead


# -- the service, with its worker processes -------------------------------------------------------


@pytest.fixture(scope="module")
def compiler() -> GrammarCompiler:
    return LazyGrammarCompiler(Tokenizer.from_gguf(builtin_model_path("smollm2-135m-instruct"))).get()


@pytest.fixture
def service(compiler: GrammarCompiler, request: pytest.FixtureRequest) -> Iterator[GrammarService]:
    limits = getattr(request, "param", None) or GrammarLimits(timeout_s=60.0)
    svc = GrammarService(lambda: compiler, limits)
    svc.warm_up()
    yield svc
    svc.close()


async def refusal(svc: GrammarService, spec: GuidedSpec) -> GuidedSpecError:
    with pytest.raises(GuidedSpecError) as info:
        await svc.compile(spec)
    assert info.value.param == spec.param
    return info.value


REFUSED = [
    (GuidedSpec("regex", "a(b", "guided_regex"), "parenthesis"),
    (GuidedSpec("grammar", "root ::= nothing_defined", "guided_grammar"), "not defined"),
    # unsatisfiable: before, a 503 "aborted by the server (shutting down)" and an ERROR log
    (GuidedSpec("regex", r"[^\s\S]", "guided_regex"), "no output can satisfy it"),
    (GuidedSpec("grammar", "root ::= root", "guided_grammar"), "no output can satisfy it"),
    (GuidedSpec("grammar", 'root ::= "a" root', "guided_grammar"), "no finite instance"),
    (GuidedSpec("grammar", 'root ::= "b" | "a" x\nx ::= x', "guided_grammar"), "rule 'x'"),
    # a required property whose schema is the whole schema again: no finite instance
    (
        GuidedSpec.json_schema(
            {"type": "object", "properties": {"next": {"$ref": "#"}}, "required": ["next"]}, "guided_json"
        ),
        "no finite instance",
    ),
    # constraints xgrammar drops with a warning
    (
        GuidedSpec.json_schema({"type": "string", "pattern": "^[a-z]+$", "maxLength": 3}, "response_format"),
        "cannot be enforced",
    ),
    (GuidedSpec("regex", "a^b", "guided_regex"), "cannot be enforced"),
    (GuidedSpec.json_schema({"oneOf": [{"type": "integer"}, {"type": "number"}]}, "guided_json"), "oneOf"),
    (GuidedSpec("json_schema", json.dumps({"$ref": "http://example.com/s"}), "guided_json"), "http://"),
]


@pytest.mark.parametrize(("spec", "problem"), REFUSED)
def test_refusals_name_the_field_and_the_problem(
    service: GrammarService, spec: GuidedSpec, problem: str
) -> None:
    err = asyncio.run(refusal(service, spec))
    assert problem in err.problem, err.problem


def test_what_compiles_is_usable_and_recursion_with_a_way_out_is_fine(service: GrammarService) -> None:
    tree = {
        "type": "object",
        "properties": {"v": {"type": "integer"}, "kids": {"type": "array", "items": {"$ref": "#"}}},
        "required": ["v", "kids"],
    }

    async def run() -> None:
        for spec, start in (
            (SMALL, "{"),
            (GuidedSpec.json_schema(tree, "guided_json"), '{"v": 1'),
            (GuidedSpec.json_schema(True, "guided_json"), "[1, "),  # JSON Schema's true: any JSON
            (GuidedSpec.choice(["yes", "no"], "guided_choice"), "ye"),
        ):
            compiled = await service.compile(spec)
            assert compiled.new_state().matcher.accept_string(start)

    asyncio.run(run())


@pytest.mark.parametrize("service", [GrammarLimits(timeout_s=1.0, workers=2)], indirect=True)
def test_a_slow_compile_is_cut_off_while_other_grammars_keep_compiling(service: GrammarService) -> None:
    async def run() -> None:
        slow = asyncio.create_task(service.compile(many_optional(3_000)))  # minutes without a limit
        await asyncio.sleep(0.2)
        await service.compile(SMALL)  # the other worker
        assert not slow.done()  # finished while the slow one was still compiling
        with pytest.raises(GuidedSpecError) as info:
            await slow
        assert "--grammar-compile-timeout" in info.value.problem
        before = service.compiles
        err = await refusal(service, dataclass_param(many_optional(3_000), "response_format"))
        assert "--grammar-compile-timeout" in err.problem and service.compiles == before  # remembered
        await service.compile(GuidedSpec.json_schema({"type": "boolean"}, "guided_json"))  # replaced worker

    asyncio.run(run())


def dataclass_param(spec: GuidedSpec, param: str) -> GuidedSpec:
    return GuidedSpec(spec.kind, spec.source, param)


@pytest.mark.parametrize(
    "service",
    [GrammarLimits(memory_bytes=mib * 2**20, max_bytes=2**20) for mib in (16, 64)],
    ids=["16MiB", "64MiB"],
    indirect=True,
)
def test_a_compile_over_the_memory_limit_is_refused(service: GrammarService) -> None:
    """Refused for memory, never for time (under CI it once was: test_the_vet_thread_always_answers),
    at a limit the compile passes early and at one it passes late."""
    big = GuidedSpec.choice([f"choice number {i} " * 3 for i in range(5_000)], "guided_choice")
    mib = service.limits.memory_bytes // 2**20

    async def run() -> None:
        err = await refusal(service, big)
        assert "--grammar-compile-memory" in err.problem and f"{mib} MiB" in err.problem, err.problem
        await service.compile(SMALL)

    asyncio.run(run())


def test_the_vet_thread_always_answers() -> None:
    """A MemoryError anywhere in a job is the memory verdict, any other exception the no-answer one,
    and the same thread, started once (before the worker's memory limit), runs every job. Under CI
    the compile above was twice reported as a timeout: a thread's own machinery raised MemoryError
    at the limit (a ThreadPoolExecutor's bookkeeping; then a per-job thread's start-up, before it
    signalled that it had started) and the worker waited until the server's deadline."""

    def out_of_memory() -> str:
        raise MemoryError

    def out_of_memory_while_handling() -> str:
        try:
            raise RuntimeError("std::bad_alloc")
        except RuntimeError:
            raise MemoryError from None

    def bug() -> str:
        raise KeyError("bogus")

    idents: set[int | None] = set()

    def where() -> str:
        idents.add(threading.get_ident())
        return "here"

    vetter = VetThread()
    assert vetter.answer(lambda: "a problem") == "a problem"
    assert vetter.answer(lambda: None) is None
    assert vetter.answer(out_of_memory) is _MEMORY
    assert vetter.answer(out_of_memory_while_handling) is _MEMORY
    assert vetter.answer(bug) is _NO_ANSWER  # the worker exits; the server reports a crash
    assert [vetter.answer(where) for _ in range(3)] == ["here"] * 3
    assert len(idents) == 1 and threading.get_ident() not in idents


@pytest.mark.parametrize("service", [GrammarLimits(timeout_s=60.0, workers=1)], indirect=True)
def test_a_crash_of_the_compiler_stays_in_its_worker(service: GrammarService) -> None:
    """xgrammar segfaulted on a JSON schema `pattern` of 30,000 nested groups (60 KB), which ended
    the server process. That one now fails the metaschema check first; a crash stays in its worker
    process: here a real SIGSEGV delivered to the worker while it compiles."""
    workers = service._ensure_workers()

    async def run() -> None:
        task = asyncio.create_task(service.compile(many_optional(3_000)))
        await asyncio.sleep(0.5)
        pid = workers[0].pid
        assert pid is not None
        os.kill(pid, signal.SIGSEGV)
        with pytest.raises(GuidedSpecError) as info:
            await task
        assert "crashed on it (signal 11)" in info.value.problem
        await service.compile(SMALL)  # on a fresh worker
        assert workers[0].pid not in (None, pid)

    asyncio.run(run())


def test_the_same_grammar_compiles_once(service: GrammarService) -> None:
    spec = GuidedSpec.json_schema({"type": "object", "properties": {"z": {"enum": [1, 2]}}}, "guided_json")

    async def run() -> None:
        before = service.compiles
        a, b = await asyncio.gather(
            service.compile(spec), service.compile(dataclass_param(spec, "tool_choice"))
        )
        again = await service.compile(spec)
        assert a is b is again and service.compiles == before + 1

    asyncio.run(run())


@pytest.mark.parametrize("service", [GrammarLimits(max_bytes=1024)], indirect=True)
def test_a_grammar_over_the_size_limit_is_refused_before_any_work(service: GrammarService) -> None:
    err = asyncio.run(refusal(service, many_optional(100)))
    assert "--grammar-max-bytes" in err.problem and service.compiles == 0


@pytest.mark.parametrize("service", [GrammarLimits(timeout_s=2.0, workers=1, queue=0)], indirect=True)
def test_grammars_beyond_the_queue_are_429(service: GrammarService) -> None:
    async def run() -> Any:
        slow = asyncio.create_task(service.compile(many_optional(3_000)))
        await asyncio.sleep(0.2)
        joined = asyncio.create_task(service.compile(many_optional(3_000)))  # waits for that compile
        with pytest.raises(GrammarQueueFullError):
            await service.compile(SMALL)
        for task in (slow, joined):
            with pytest.raises(GuidedSpecError):
                await task
        await service.compile(SMALL)  # the queue drained

    asyncio.run(run())


def test_the_limits_come_from_the_serve_flags(capsys: pytest.CaptureFixture[str]) -> None:
    import argparse

    from kvpilot.runtime import cli

    parser = argparse.ArgumentParser()
    cli.add_arguments(parser)
    assert GrammarLimits.from_config(cli.build_config(parser.parse_args([]))) == GrammarLimits()
    argv = ["--grammar-compile-timeout", "2.5", "--grammar-compile-memory", "512MiB"]
    argv += ["--grammar-compile-workers", "3", "--grammar-compile-queue", "0", "--grammar-max-bytes", "64KiB"]
    limits = GrammarLimits.from_config(cli.build_config(parser.parse_args(argv)))
    assert limits == GrammarLimits(2.5, 512 * 2**20, 3, 0, 64 * 2**10)
    assert cli.run(parser.parse_args(["--grammar-compile-timeout", "0"])) == 2
    assert "--grammar-compile-timeout" in capsys.readouterr().err
