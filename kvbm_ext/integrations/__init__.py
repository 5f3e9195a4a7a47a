"""Integrations of kvbm_ext into engines it does not own.  Each module is imported only when
used, and its engine is an optional extra of kvbm_ext, never a dependency:

  kvbm_ext.integrations.transformers   transformers' continuous batching (5.17 and 5.24)
                                        offloads and restores through kvbm_ext (extra
                                        [transformers]; without it, the import raises
                                        ImportError naming it)
  kvbm_ext.integrations.vllm           an OffloadingSpec for vLLM's OffloadingConnector
                                        (extra [vllm])
"""
