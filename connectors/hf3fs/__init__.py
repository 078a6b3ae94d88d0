"""HF3FS store: KV pages in files (3FS usrbio or any POSIX filesystem) with a page index
that is in-process (one process per file) or a durable gRPC service shared by many nodes.

Importing this package imports neither grpc nor hf3fs bindings; ``store.HF3FSStore`` pulls
grpc only when ``metadata_server_url`` is set.
"""
