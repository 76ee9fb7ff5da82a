"""FastDeploy-compatible import paths, so published processors run after renaming the package."""
