"""The UCX transport of the weight plane (ucxx): transport.py is the way in, and its docstring
maps the modules beside it."""
