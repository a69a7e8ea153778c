"""Benchmark and profile speculative decoding: measured speed, acceptance and the analytic model's cost terms.

`bench` (batch 1, every method on the same prompts):
  plan      what a run measures, from the flags, before anything loads: sets, K sweep, sizes, the full run
  timing    measured cost terms: draft/target cost ratio c and verify cost per K
  prompts   built-in prompt sets (held-out code, generated JSON, prose, chat with a shared system prompt)
  measure   timing of one generation (our runtime or Hugging Face) into a Sample
  records   samples -> results.json records, and the printed table
  spread    the repeats' spread, noisy cells, and the best variant picked by median (within noise or not)
  memory    the memory-bound limit: target weight bytes over measured read bandwidth
  runner    one bench run over all methods; estimate: how long it will take, said before the timed part
  report    results.json, the printed table and summary; plot: the PNG; cli: the bench/profile subcommands
  profile   recommend a draft and K from measurements on the user's prompts, before any build, overall and per
            set label (profile_results: the figures, the recommendations, the tables)

`bench-serve` (concurrent clients against the engine and a real tritonserver):
  request_timing  one request's timing as its client saw it; a load's timings -> rates and percentiles
  serve_clients   the clients: ServingLoop in this process, Triton HTTP, Triton gRPC stream
  load_generator  one load: C client threads, N requests (optionally one at a time)
  serve_matrix    modes x paths x concurrency, rounds interleaved, each cell's best; ratios between modes
  hf_baseline     batch-1 target-only against Hugging Face generate
  serve_report    the printed table and the serving goals; serve_plot: the PNG
  triton_launch   deploy and start tritonserver on free loopback ports
  serve_cli       the bench-serve subcommand

arg_checks: argument checks shared by the subcommands. The speedup model itself is pipeline.speculative.analytic.
"""
