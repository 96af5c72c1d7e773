"""The run itself: the streaming loop both runtimes share, where the roles run (`local`: one
process; `ray`: Ray actors; `simulated`: a virtual cluster), the parts built from config,
recovery, the accounting, metrics and the memory allocator settings.
"""
