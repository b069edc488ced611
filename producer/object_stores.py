"""One obstore client for one bucket of s3://, gs:// or az://, with gpufeed's credential
rules: the worker that fetches objects and `producer batch` that lists them hold the same.

Credentials and endpoints come from the environment, never from a job: each store's
standard chain (AWS_*, GOOGLE_*, AZURE_*), plain HTTP only with <PREFIX>_ALLOW_HTTP=true,
and for S3, where boto3 is installed and an AWS profile is in use (AWS_PROFILE, or
~/.aws/credentials without AWS_ACCESS_KEY_ID), boto3's chain, so profiles and SSO work as
in the AWS CLI. obstore is imported only when a store is opened.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from obstore.store import ClientConfig, ObjectStore, RetryConfig, S3CredentialProvider

ENV_PREFIX = {"s3": "AWS", "gs": "GOOGLE", "az": "AZURE"}


def open_store(
    scheme: str,
    bucket: str,
    client_options: ClientConfig | None = None,
    retry_config: RetryConfig | None = None,
) -> ObjectStore:
    """A client for `scheme://bucket` (scheme: s3, gs or az)."""
    from obstore.store import from_url

    options: ClientConfig = dict(client_options or {})  # type: ignore[assignment]
    if _env_true(f"{ENV_PREFIX[scheme]}_ALLOW_HTTP"):
        # Options given here replace the ones the store reads from its environment.
        options["allow_http"] = True
    url = f"{scheme}://{bucket}"
    provider = _boto3_provider() if scheme == "s3" else None
    if provider is not None:
        return from_url(
            url, client_options=options, retry_config=retry_config, credential_provider=provider
        )
    return from_url(url, client_options=options, retry_config=retry_config)


def _env_true(name: str) -> bool:
    return os.environ.get(name, "").strip().lower() in ("1", "true", "yes", "on")


def _boto3_provider() -> S3CredentialProvider | None:
    """boto3's credential chain where a profile is in use and boto3 is installed."""
    profile = os.environ.get("AWS_PROFILE")
    files = Path("~/.aws/credentials").expanduser().exists()
    if not profile and not (files and not os.environ.get("AWS_ACCESS_KEY_ID")):
        return None
    try:
        from obstore.auth.boto3 import Boto3CredentialProvider
    except ImportError:
        return None
    provider: S3CredentialProvider = Boto3CredentialProvider()
    return provider
