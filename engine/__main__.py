"""`python -m engine ...` is the `grpo-engine` command."""

from engine.cli import main

raise SystemExit(main())
