"""Drop-in surfaces of other libraries, built on tensorstream's public classes.

``tensorstream.compat.tensorizer`` mirrors CoreWeave tensorizer 2.12.1's API
(``from tensorstream.compat import tensorizer``). Each compat package is a thin
adapter: it renames arguments and translates behaviour, never re-implements
loading or writing, and imports nothing above itself.
"""
