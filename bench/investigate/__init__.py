"""Investigation scripts: one-off measurements behind docs/engine.md, each runnable as
``python bench/investigate/<name>.py`` (README.md says what each measures)."""
