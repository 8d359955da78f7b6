"""Backend-agnostic transformer forward and per-architecture data (configs, name tables)."""
