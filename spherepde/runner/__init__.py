"""From a TOML config to run files: reading and checking configs, one run (`spherepde run`), and
parameter sweeps on dask.distributed (`spherepde sweep`)."""
