"""What lynx keeps between runs, on disk, and the keys it keeps it under.

``plans`` (lynx's winning plan per graph, budget and machine), ``autograd`` (torch's AOTAutograd
cache for lynx's graphs, and the record kept beside it), ``source_digest`` (lynx's own sources,
part of every key). Nothing here is imported by this ``__init__``: import the module you need.
"""
