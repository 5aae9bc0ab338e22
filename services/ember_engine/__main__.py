from ember_engine.cli import main

main()
