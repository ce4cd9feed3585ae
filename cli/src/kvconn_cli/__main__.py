"""``python -m kvconn_cli``: the same as the ``kvconn`` console script."""

from .app import main

main()
