"""Where tfdp meets other engines (Ray Train); each submodule imports its engine only when used."""
