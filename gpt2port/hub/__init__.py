"""The Hugging Face Hub: names -> repos and files (names), verified files in the cache (fetch), and the whole
download -> convert -> verify job (download)."""

from gpt2port.hub.download import DownloadResult, download

__all__ = ["DownloadResult", "download"]
