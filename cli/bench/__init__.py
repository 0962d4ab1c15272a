"""The terminal side of `llmrun bench`, `bench serve`, `bench interference` and `tune`: options,
progress, tables, charts. The measuring lives in runners/bench/ and runners/serving/."""
