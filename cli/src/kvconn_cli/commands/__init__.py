"""One module per ``kvconn`` command; each defines ``register(app: typer.Typer)``."""
