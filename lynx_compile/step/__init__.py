"""A training step compiled as several pieces, planned as one (issue M item 3; ``docs/budget_pieces.md``).

    piece ──(dynamo calls it)──▶ recorder ──marks──▶ memory_marks ──segments──▶ model ──pick──▶ recorder
                                    ├──▶ hint (the peak a whole graph's plan gave, for the next run)
                                    ├──▶ cached (the step's plan or refusal, kept in the plan cache)
                                    ├──▶ sizes (data-dependent sizes as step 1 ran them)
                                    └──▶ device_budget (what the device holds besides the step)

``piece.Piece`` is the callable dynamo gets for one compiled graph; ``recorder.StepRecorder``
records a step's pieces and their memory between marks (``memory_marks``), asks ``model`` (plain
arithmetic, no torch) for the one candidate per piece that keeps the step within the budget, and
swaps each piece to it; ``hint`` keeps a whole graph's step peak for the next run, ``cached`` the
step's plan; ``sizes`` plans an MoE block again with the routed counts step 1 ran;
``device_budget`` reads what ``device_budget`` must hold besides the step. Nothing here is
imported by this ``__init__``: import the module you need.
"""
