"""Writing a bundle: each model's graphs at its precision and their checks (decoder_build,
build_seq2seq), the drafts (draft_plan, draft_vocab), the measured costs (costs), the build's
options and progress, and where it writes (output, journal, leftovers); what it prints when
done (summary). spec_export/build.py (`build_bundle`) runs these stages."""
