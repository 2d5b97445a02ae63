"""mgk's attention kinds inside other libraries' models. Each integration is a subpackage that imports its library
only when it is itself imported (:mod:`mgk.integrations.hf`: Hugging Face transformers, extra ``hf``); nothing
else in mgk imports them."""
