"""The backend torch.compile calls: from dynamo's graph to compiled forward and backward.

``dynamo_backend`` (``backend="lynx"``: options, the first call, Inductor's compile),
``inductor_partition`` (lynx's partition inside Inductor's own pipeline, ``compiler="inductor"``),
``eager_compile`` (``compiler="eager"``: AOTAutograd with lynx's partition, the graphs run op by op
with the runtimes the options ask for) and ``progress`` (a line on stderr while one graph's
compile takes long). Nothing here is imported by this ``__init__``: import the module you need.
"""
