"""Stage 2, deciding: ``plan_load`` turns a request and facts into a frozen ``LoadPlan``.

Every module here is a pure function of facts (the model's config, the machine's facts, what is
installed); none loads weights or initialises a device.
"""
