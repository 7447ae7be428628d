"""_store: object storage for checkpoints (an S3 bucket, a folder), see CONTRIBUTING.md
(the layers) and docs/object_storage.md. Imports only ``errors`` and ``_core``; never
torch.distributed; the S3 client library is imported only when an ``s3://`` store is
opened."""
