# Not installed, never imported: it marks the checkout's root as the package that holds the design
# card's folders (cloud/, edge/, shared/, proto/), as `harken` holds them once installed (pyproject's
# package-dir map, harken/'s symlinks). With it, a tool that knows nothing of that map (an editor
# without the install, a static import graph) resolves each relative import that crosses folders,
# `from ...shared.protocol import Start` in cloud/hosting/, to its file.
