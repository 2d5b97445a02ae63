"""The transformers versions mgk.integrations.hf supports (no transformers import here, so that its absence can be
reported with them). pyproject's extra ``hf`` declares the same range (tests/integrations checks they agree)."""

# 4.56 brought per-layer cache slots (Cache.layers), which MGKCacheLayer takes; the tests ran at 4.56.0 and 5.24.0
TRANSFORMERS_RANGE = (">=4.56", "<6")
REQUIREMENT = "transformers" + ",".join(TRANSFORMERS_RANGE)
