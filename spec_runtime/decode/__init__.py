"""Decoding: the numeric core, pure numpy.

    sampling.py     SamplingParams (the sampling controls, declared once), warp, acceptance
    loop.py         the draft-then-verify loop and its per-request state
    gamma.py        γ: an integer or AUTO
    drafts.py       the Draft protocol and its registry (model, n-gram, hybrid)
    draft_vocab.py  a draft head trimmed to some of the target's ids
    stats.py        what a generation measured, and the paper's expected speed-up
    constraint.py   response_format: a grammar that masks draft and target alike
"""
