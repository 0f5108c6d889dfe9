"""Several requests on one loaded bundle (what `specrun serve --slots N` runs): Generator.fork
shares the ONNX Runtime sessions and keeps its own caches; requests on forks decode in parallel
threads exactly as they decode one after the other; a request can be cancelled between rounds."""

import threading

import pytest
from toy_models import ToyEngine

import spec_runtime
from spec_runtime import CacheCapacityError, Generator, ModelDraft, NgramDraft
from spec_runtime.decode.drafts import HybridDraft

PROMPTS = ["abc abc abc", "hello world", "the cat sat on the mat", "xyz"]


def test_a_fork_shares_the_sessions_and_owns_its_caches(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    fork = gen.fork()
    assert fork.target.session is gen.target.session
    assert fork.draft.engine.session is gen.draft.engine.session
    assert fork.target.cache is not gen.target.cache
    assert fork.draft.engine.cache is not gen.draft.engine.cache
    assert fork.tokenizer is gen.tokenizer and fork.eos_token_ids == gen.eos_token_ids


@pytest.mark.parametrize("settings", [{}, {"temperature": 1.0, "top_p": 0.9}])
def test_requests_on_forks_in_parallel_equal_the_same_requests_in_turn(llama_pair, settings):
    gen = spec_runtime.load(llama_pair[2])
    gen.eos_token_ids = frozenset()
    alone = {(p, s): gen.generate(p, max_new_tokens=30, chat=False, seed=s, **settings).tokens
             for p in PROMPTS for s in (1, 2)}
    generators = [gen, gen.fork(), gen.fork()]
    got, errors = {}, []

    def worker(g, jobs):
        try:
            for p, s in jobs:
                got[p, s] = g.generate(p, max_new_tokens=30, chat=False, seed=s,
                                       **settings).tokens
        except Exception as e:  # reported below; a thread's exception is otherwise lost
            errors.append(e)

    jobs = list(alone)
    threads = [threading.Thread(target=worker, args=(g, jobs[i::3]))
               for i, g in enumerate(generators)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and got == alone


class UnforkableEngine(ToyEngine):
    """A toy engine kind that cannot fork its cache, as an engine of another kind may not."""

    fork = property(lambda self: None)  # getattr(engine, "fork", None) is None


def test_an_engine_without_fork_is_one_slot_and_says_so():
    """Every draft kind forks; an engine kind that cannot fork its cache (here a toy engine)
    refuses a second slot with the reason, for the target and for a draft's model alike."""
    target = UnforkableEngine(max_len=64, seed=0)
    ngram = NgramDraft(6, max_ngram=4, min_ngram=2)
    forked = ngram.fork()
    assert forked is not ngram and (forked.max_ngram, forked.min_ngram) == (4, 2)
    model = ModelDraft(UnforkableEngine(max_len=64, seed=1, like=target, mix=0.5))
    for draft in (model, HybridDraft(model, ngram)):
        with pytest.raises(spec_runtime.InputError, match="one request at a time"):
            draft.fork()
    with pytest.raises(spec_runtime.InputError,
                       match="UnforkableEngine holds one request at a time"):
        Generator(target, ngram).fork()


def test_capacity_counts_a_hybrid_drafts_model_cache():
    """A hybrid draft's model engine holds a cache too: a request that overflows it is refused
    before decoding, not halfway."""
    target = ToyEngine(max_len=64, seed=0)
    small = ModelDraft(ToyEngine(max_len=20, seed=1, like=target, mix=0.5))
    gen = Generator(target, HybridDraft(small, NgramDraft(6)))
    assert gen.capacity() == 20 and gen.capacity(use_draft=False) == 64
    with pytest.raises(CacheCapacityError, match="max_len is 20"):
        gen.generate([1, 2, 3], max_new_tokens=30)
    assert len(gen.generate([1, 2, 3], max_new_tokens=30, use_draft=False).tokens) <= 30


def test_cancel_ends_a_request_after_the_round_in_flight(llama_pair):
    gen = spec_runtime.load(llama_pair[2])
    gen.eos_token_ids = frozenset()
    cancel = threading.Event()
    pieces = []
    stream = gen.stream("abc abc abc", max_new_tokens=60, chat=False, cancel=cancel)
    for piece in stream:
        pieces.append(piece)
        cancel.set()  # after the first round
    r = stream.result
    assert r.finish_reason == "cancelled" and 1 <= len(r.tokens) <= 5  # one round: <= γ + 1
    assert r.text == "".join(pieces)
    full = gen.generate("abc abc abc", max_new_tokens=60, chat=False)  # the engines are free
    assert full.tokens[:len(r.tokens)] == r.tokens and len(full.tokens) == 60
    done = threading.Event()
    done.set()  # set before the start: one round, then the end
    assert gen.generate("hello", max_new_tokens=60, chat=False,
                        cancel=done).finish_reason == "cancelled"
