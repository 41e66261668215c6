from rlhf_lab.app.cli import main

if __name__ == "__main__":
    main()
