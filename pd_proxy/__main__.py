"""``python -m pd_proxy``: the same as the ``sla-guard-proxy`` console script."""

from pd_proxy.cli import main

raise SystemExit(main())
