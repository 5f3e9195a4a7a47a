"""Other projects' Python APIs over kvbm_ext's functions, so that code written against
them runs unchanged.  Each module is imported only when used:

  kvbm_ext.compat.dynamo   Dynamo kvbm-kernels' block / universal / operational functions
"""
