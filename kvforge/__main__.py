from kvforge.cli import main

main()
