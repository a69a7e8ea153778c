"""Benchmark and profile speculative decoding: measured speed, acceptance and the analytic model's cost terms.

  analytic  pure functions of the speedup model (expected tokens per step, Leviathan bound, best K)
  timing    measured cost terms: draft/target cost ratio c and verify cost per K
  prompts   built-in prompt sets (held-out code, generated JSON, prose)
  measure   timing of one generation (our runtime or Hugging Face) into a Sample
  records   samples -> results.json records, and the printed table
  runner    one bench run over all methods; plot: the PNG; cli: the bench/profile subcommands
  profile   recommend a draft and K from measurements on the user's prompts, before any build
"""
