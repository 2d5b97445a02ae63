"""The index of attention kinds: importing a kind's file registers it (its ``register(...)`` calls sit at its bottom).
Registration order is the order of :func:`mgk.attention.attention_kinds`, of tables and of reports: the paper's six
kinds (Nguyen et al., ICML 2022: softmax, MGK and sMGK, Tables 1, 3, 4; linear, MLK and sMLK, Tables 2, 3), then the
baselines added since. A new kind is a new file, and one line here."""
# isort: skip_file
from . import softmax  # noqa: F401  softmax
from . import mgk  # noqa: F401  mgk, smgk
from . import linear  # noqa: F401  linear, mlk, smlk
from . import gqa  # noqa: F401  gqa (grouped-query and multi-query attention)
from . import gmgk  # noqa: F401  gmgk (grouped mixture keys: MGK keys shared by groups of query heads)
