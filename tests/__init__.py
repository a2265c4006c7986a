"""safevars' tests, laid out like the code (CONTRIBUTING.md, "How the tests are laid out")."""
