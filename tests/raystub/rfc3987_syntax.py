"""Put first on PYTHONPATH of the Ray tests only: jsonschema (which Ray imports in every one of its processes)
imports this optional package when it is installed (jupyterlab brings it), and it builds a Lark grammar at import:
about 3 s of CPU per process. On 2 busy cores that pushes Ray's dashboard agent past the raylet's hard-coded 15 s
start-up limit (ray-project/ray#65983) and `ray.init` fails. Without it jsonschema skips one format checker ("iri")
that neither Ray nor hetero uses."""
raise ImportError("rfc3987_syntax is left out of the Ray tests' processes (tests/raystub)")
