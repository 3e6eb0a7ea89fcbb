"""The benchmark harness: `runner.score` scores a model under `settings.EvalSettings` (the paper's
benchmarks from `catalog`, held-out likelihoods from `likelihood`), and `record.score_and_record`
appends the result to a run's record. What is built from records (tables, figures) is `reports`."""
