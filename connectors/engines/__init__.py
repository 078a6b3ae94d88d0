"""Engine integrations: SGLang HiCache, LMCache MP server, SGLang PD."""
