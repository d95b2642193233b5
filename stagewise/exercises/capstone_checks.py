"""Checks for notebook 16: the student's engine step, run beside `LLM()`'s paged engine, step by step.

`run` steps the student's engine (`capstone.Engine` on the student's parts, driven by the student's
`step`) and the package's engine (`LLM(mode="paged")`, its scheduler and block manager with the same
seats, budget and pool) in lockstep, and after every step compares what a step decides: the
requests that ran and how many tokens each computed, the token budget, the seats (who runs, who
waits, in order), the blocks each request holds, and the tokens sampled. The first difference is a
FAIL naming the step; an engine that stops while the package's goes on is a FAIL naming the step it
stalled at.

The parts come from `my_parts.py` (what the earlier notebooks kept, `my_parts.py` in this package)
or, only when asked, from the shipped solutions; `whose` says which part came from where.
"""

from collections import deque
from dataclasses import dataclass
from pathlib import Path

from stagewise.exercises import my_parts
from stagewise.exercises.capstone import PARTS, Engine, Parts, Seq
from stagewise.exercises.core import Mismatch, NotYet, call, equal

SOLUTIONS = Path(__file__).resolve().parents[2] / "notebooks" / "solutions"
STEP = "16.engine_step"  # the step itself, in `Capstone.whose`


@dataclass
class Workload:
    prompts: list[str]
    max_tokens: int  # tokens each request generates (greedy, no stop)
    num_blocks: int  # blocks in the pool
    block_size: int
    budget: int  # tokens per step
    seats: int  # requests running at once
    prefix_caching: bool


@dataclass
class Capstone:
    """A step function and the answers it runs on (exercise name -> function), with where each came from."""

    step: object
    answers: dict
    whose: dict  # exercise name -> "yours", "solution" or "missing"


def load_solutions(folder=SOLUTIONS) -> dict:
    """Every `notebooks/solutions/nbNN.py`'s SOLUTIONS, merged: exercise name -> function."""
    import importlib.util

    solved = {}
    for path in sorted(Path(folder).glob("nb*.py")):
        spec = importlib.util.spec_from_file_location(f"solutions_{path.stem}", path)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
        solved.update(module.SOLUTIONS)
    return solved


def assemble(step, folder=None, use_solutions: bool = False) -> Capstone:
    """The parts the student kept in `folder`/my_parts.py; the shipped solutions fill the rest only when asked."""
    mine, _ = my_parts.load(folder)
    solved = load_solutions() if use_solutions else {}
    answers, whose = {}, {}
    for name in PARTS.values():
        if name in mine:
            answers[name], whose[name] = mine[name], "yours"
        elif name in solved:
            answers[name], whose[name] = solved[name], "solution"
        else:
            whose[name] = "missing"
    if step is None and use_solutions:
        step, whose[STEP] = solved["16.engine"], "solution"
    else:
        whose[STEP] = "yours" if step is not None else "missing"
    return Capstone(step, answers, whose)


def reference(loaded, w: Workload):
    """The package's paged engine with the workload's limits; -> (llm, its requests in order)."""
    from stagewise.config import EngineConfig
    from stagewise.engine.llm import LLM
    from stagewise.sampling_params import SamplingParams

    ecfg = EngineConfig(
        max_num_seqs=w.seats,
        max_num_batched_tokens=w.budget,
        block_size=w.block_size,
        num_kv_blocks=w.num_blocks,
        enable_prefix_caching=w.prefix_caching,
        max_model_len=256,
    )
    llm = LLM(loaded, mode="paged", engine_config=ecfg)
    params = SamplingParams(max_tokens=w.max_tokens, temperature=0, ignore_eos=True)
    for prompt in w.prompts:
        llm.add_request(prompt, params)
    return llm, list(llm.engine.scheduler.waiting)


def reference_steps(loaded, w: Workload) -> tuple[list[list[tuple[str, int]]], dict[str, int]]:
    """What LLM()'s paged engine computes in each step of the workload, [(r0, tokens), ...] per step,
    and the prompt tokens each request found in the prefix cache (read from its scheduler's output)."""
    llm, refs = reference(loaded, w)
    names, steps, reused = {r.request_id: f"r{i}" for i, r in enumerate(refs)}, [], {}
    sched, outputs = llm.engine.scheduler, []
    schedule = sched.schedule

    def recorded():  # the scheduler's own answer, kept as it is handed to the engine
        outputs.append(schedule())
        return outputs[-1]

    sched.schedule = recorded
    while llm.has_unfinished_requests():
        llm.step()
        steps.append([(names[s.request.request_id], s.num_new_tokens) for s in outputs[-1].scheduled])
        for s in outputs[-1].scheduled:
            reused[names[s.request.request_id]] = reused.get(names[s.request.request_id], 0) + s.num_cached_tokens
    return steps, reused


def _compare(k: int, engine: Engine, running, waiting, sampled, llm, refs, names, before, w: Workload) -> None:
    """Everything one step decided, the student's engine against the package's; Mismatch at the first difference."""
    at, sched, bm = f"step {k}", llm.engine.scheduler, llm.engine.block_manager
    if not engine.forwarded and any(r.num_computed_tokens != before[names[r.request_id]][1] for r in refs):
        raise Mismatch(f"{at}: your engine stalled here: its step ran no forward pass while LLM()'s computed tokens")
    spent = sum(n for _, n in engine.forwarded)
    if spent > w.budget:
        raise Mismatch(f"{at}: the forward pass computed {spent} tokens, over the budget of {w.budget}")
    if len(running) > w.seats:
        raise Mismatch(f"{at}: {len(running)} requests running, more than max_num_seqs = {w.seats}")
    ran = {rid: s.num_computed_tokens - before[rid][0] for rid, s in engine.seqs.items()}
    theirs = {names[r.request_id]: r.num_computed_tokens - before[names[r.request_id]][1] for r in refs}
    equal({r: n for r, n in ran.items() if n > 0}, {r: n for r, n in theirs.items() if n > 0},
          f"{at}: tokens computed per request (prefix-cache hits included)")  # fmt: skip
    equal([s.request_id for s in running], [names[r.request_id] for r in sched.running], f"{at}: running afterwards")
    equal([s.request_id for s in waiting], [names[r.request_id] for r in sched.waiting], f"{at}: waiting afterwards")
    new_tokens = []
    for r in refs:
        rid, seq = names[r.request_id], engine.seqs[names[r.request_id]]
        equal(engine.rows.get(rid, []), bm.block_ids(r.request_id), f"{at}: blocks held by {rid}")
        equal(seq.num_computed_tokens, r.num_computed_tokens, f"{at}: {rid}'s computed tokens")
        equal(seq.generated, list(r.output_token_ids), f"{at}: {rid}'s tokens so far (LLM()'s greedy tokens)")
        new_tokens += [(rid, t) for t in r.output_token_ids[before[rid][2] :]]
    try:
        got = sorted((str(rid), int(t)) for rid, t in sampled)
    except (TypeError, ValueError):
        raise Mismatch(f"{at}: your step returned {sampled!r:.60}, not a list of (request id, token)") from None
    equal(got, sorted(new_tokens), f"{at}: the (request id, token) pairs your step returned")


def run(loaded, capstone: Capstone, w: Workload) -> dict:
    """Step the student's engine beside LLM()'s until both are done; -> what happened (for the notebook)."""
    missing = [n for n, who in capstone.whose.items() if who == "missing" and n != STEP]
    if missing:
        raise NotYet(f"parts not yours yet: {', '.join(missing)} (their check cells keep each passing answer)")
    llm, refs = reference(loaded, w)
    engine = Engine(loaded, Parts(capstone.answers), w.num_blocks, w.block_size, w.budget, w.seats, w.prefix_caching)
    names = {r.request_id: f"r{i}" for i, r in enumerate(refs)}  # LLM()'s ids -> r0, r1, ...
    for r in refs:
        engine.seqs[names[r.request_id]] = Seq(names[r.request_id], list(r.prompt_token_ids), w.max_tokens)
    running, waiting = [], deque(engine.seqs.values())
    steps, k = [], 0
    while llm.has_unfinished_requests():
        if not (running or waiting):
            raise Mismatch(f"step {k}: your engine has finished every request; LLM()'s has not")
        before = {  # request -> (your computed tokens, LLM()'s, LLM()'s tokens so far)
            names[r.request_id]: (engine.seqs[names[r.request_id]].num_computed_tokens, r.num_computed_tokens,
                                  len(r.output_token_ids))
            for r in refs
        }  # fmt: skip
        engine.forwarded, engine.calls = [], 0
        try:
            sampled = call(capstone.step, engine, running, waiting)
        except (Mismatch, NotYet):
            raise
        except Exception as err:  # the student's step: say at which step, keep the notebook running
            raise RuntimeError(f"step {k}: {type(err).__name__}: {err}") from err
        llm.step()
        _compare(k, engine, running, waiting, sampled, llm, refs, names, before, w)
        steps.append(list(engine.forwarded))
        k += 1
    if running or waiting:
        stuck = ", ".join(s.request_id for s in [*running, *waiting])
        raise Mismatch(f"step {k}: LLM()'s engine finished here; yours stalled with {stuck} unfinished")
    return {"steps": steps, "tokens": [s.generated for s in engine.seqs.values()], "calls": dict(engine.ops.calls)}


def _capstone_of(answer) -> Capstone:
    """A Capstone, or the student's step alone: its parts then come from my_parts.py in this folder."""
    return answer if isinstance(answer, Capstone) else assemble(answer)


# Four requests, 2 seats, 8 tokens per step, blocks of 4, a pool of 5 blocks (the largest request
# needs all 5): the first two take both seats while the others wait, prompts are chunked, requests
# running together outgrow the pool (preemptions) and some allocations take exactly the blocks left.
# Prefix caching is off here (a resumed request would find its own freed blocks, which the package's
# scheduler charges to the budget differently); the second workload turns it on, with one seat.
ENGINE = Workload(["one two", "one two three", "the cat sat on the mat", "hello there, how are you today"],
                  max_tokens=4, num_blocks=5, block_size=4, budget=8, seats=2, prefix_caching=False)  # fmt: skip
SHARED = "the cat sat on the mat and looked at the dog. "
PREFIX = Workload([SHARED + "then it slept", SHARED + "then it ran away"],
                  max_tokens=2, num_blocks=24, block_size=4, budget=64, seats=1, prefix_caching=True)  # fmt: skip


def check_engine(answer) -> str:
    """my_engine_step(engine, running, waiting) -> [(request id, token)]: on the tiny model, beside LLM()."""
    from stagewise.exercises.engine_checks import tiny_model

    capstone = _capstone_of(answer)
    out = run(tiny_model(), capstone, ENGINE)
    return f"{len(out['steps'])} steps equal LLM()'s paged engine: computed tokens, seats, budget, blocks, tokens"


def check_shared_prefix(answer) -> str:
    """Two requests sharing a prompt prefix, one seat: the second reuses the first's blocks, as LLM()'s does."""
    from stagewise.exercises.engine_checks import tiny_model

    out = run(tiny_model(), _capstone_of(answer), PREFIX)
    return f"{len(out['steps'])} steps with the prefix cache equal LLM()'s paged engine, blocks shared included"


CHECKS = {"16.engine": check_engine, "16.shared_prefix": check_shared_prefix}
