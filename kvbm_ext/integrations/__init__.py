"""Integrations of kvbm_ext into engines it does not own.  Each module is imported only when
used, and its engine is an optional extra of kvbm_ext, never a dependency:

  kvbm_ext.integrations.transformers   transformers' continuous batching offloads and
                                        restores through kvbm_ext (extra [transformers])
"""
